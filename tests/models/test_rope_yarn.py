"""YaRN RoPE scaling equals transformers': frequencies, attention factor and a Llama's logits."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ptx.model_config import RopeScaling
from ptx.models import forward, load_hf, rope

torch = pytest.importorskip("torch", reason="HF parity tests need torch (installed by `make test`)")
transformers = pytest.importorskip("transformers", reason="HF parity tests need transformers (`make test`)")

T = 40  # past the original context (16) the scaled frequencies matter
_LLAMA = dict(vocab_size=264, hidden_size=40, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, head_dim=14, rms_norm_eps=1e-6, max_position_embeddings=64)


def _hf_rope(head_dim, theta, params):
  """transformers' (inv_freq, attention factor) for `rope_parameters`."""
  config = transformers.LlamaConfig(**{**_LLAMA, "head_dim": head_dim},
                                    rope_parameters={"rope_theta": theta, **params})
  inv_freq, factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
  return inv_freq.numpy(), factor


@pytest.mark.parametrize("params", [
    dict(factor=4.0, original_max_position_embeddings=16),
    dict(factor=8.0, original_max_position_embeddings=4096, beta_fast=16, beta_slow=2, truncate=False),
    dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.7),
    dict(factor=2.0, original_max_position_embeddings=2048, attention_factor=1.3),
])
def test_frequencies_and_attention_factor_match_transformers(params):
  head_dim, theta = 128, 500_000.0
  want_inv_freq, want_factor = _hf_rope(head_dim, theta, {"rope_type": "yarn", **params})
  scaling = RopeScaling(
      kind="yarn", factor=params["factor"], original_max_positions=params["original_max_position_embeddings"],
      beta_fast=params.get("beta_fast", 32.0), beta_slow=params.get("beta_slow", 1.0),
      attention_factor=params.get("attention_factor"), mscale=params.get("mscale", 0.0),
      mscale_all_dim=params.get("mscale_all_dim", 0.0), truncate=params.get("truncate", True))
  got = rope.inverse_frequencies(head_dim, theta, scaling)
  # float32 on both sides, theta ** e by two pow implementations: one that goes through exp(e ln theta) carries the
  # rounding of e ln theta, a relative error up to ln(5e5) * 2^-24 = 7.8e-7 (seen 6.3e-7, 64% of rtol 1e-6). rtol 1e-5
  # leaves room for that on either side; a wrong YaRN ramp is off by percents.
  np.testing.assert_allclose(np.asarray(got), want_inv_freq, rtol=1e-5)
  # A Python float on both sides, the same formula: float64 rounding only.
  assert rope.attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.slow
def test_llama_with_yarn_matches_transformers_logits(tmp_path):
  yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10_000.0}
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA, rope_parameters=yarn))
  torch.manual_seed(0)
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.2)
  model.eval()
  tokens = np.random.default_rng(1).integers(0, _LLAMA["vocab_size"], (2, T))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.float().numpy()
  # The weights as a plain Llama checkpoint; the scaling is set on ptx's side.
  model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10_000.0}
  model.save_pretrained(tmp_path)
  loaded = load_hf(tmp_path)
  cfg = dataclasses.replace(loaded.cfg, rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_positions=16))
  got = forward(loaded.params, jnp.asarray(tokens, jnp.int32), cfg)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)  # HF parity, as in tests/models/test_hf.py
