"""DeepSeek-V3 (multi-head latent attention, sigmoid-routed experts, dense first layers) against transformers.

A tiny DeepseekV3ForCausalLM with every weight redrawn (norms, e_score_correction_bias and the router included) and
YaRN rope scaling, saved by transformers (its rotary rows interleaved), loaded by ptx: logits within 1e-4 of
transformers' in float32, as tests/models/test_hf.py asks of every family; saved back, the directory loads bit-exact
in ptx and to the same logits in transformers.
"""

import json

import jax
import numpy as np
import pytest

from hf_parity import hf_logits as _hf_logits
from hf_parity import ptx_logits as _ptx_logits
from hf_parity import randomize
from ptx.config import MeshConfig
from ptx.models import hf_config, load_hf, save_hf
from ptx.models.params import param_shardings
from ptx.sharding import make_mesh

torch = pytest.importorskip("torch", reason="HF parity tests need torch (installed by `make test`)")
transformers = pytest.importorskip("transformers", reason="HF parity tests need transformers (`make test`)")

pytestmark = pytest.mark.slow

T = 24  # past YaRN's original context (16), where the scaled frequencies matter
# Pairwise distinct widths: d_model 40, 8 heads, nope 10, rope 4, v 6, q rank 20, kv rank 12, dense MLP 96, experts 16.
_CONFIG = dict(vocab_size=264, hidden_size=40, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
               num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=8,
               num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
               q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=10, qk_rope_head_dim=4, v_head_dim=6,
               rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.8})
VARIANTS = {"q_lora": {}, "no_q_lora": {"q_lora_rank": None}}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
  """(name, directory, tokens, transformers logits) of a saved tiny random DeepSeek-V3."""
  config = transformers.DeepseekV3Config(**{**_CONFIG, **VARIANTS[request.param]})
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  randomize(model, 0)  # norms included, so that their weights matter
  with torch.no_grad():
    for layer in model.model.layers[config.first_k_dense_replace:]:  # a buffer, zero in a fresh model
      layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts))
  model.eval()
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path)
  tokens = np.random.default_rng(1).integers(0, _CONFIG["vocab_size"], (2, T))
  return request.param, path, tokens, _hf_logits(model, tokens)


def test_load_matches_transformers(checkpoint):
  name, path, tokens, expected = checkpoint
  model = load_hf(path)
  cfg = model.cfg
  assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.head_dim, cfg.v_head_dim) == (
      20 if name == "q_lora" else 0, 12, 4, 6)
  assert (cfg.moe.dense_layers, cfg.moe.shared_mlp_dim, cfg.moe.router, cfg.moe.n_groups) == ((0,), 16, "sigmoid", 2)
  assert cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.mscale_all_dim == 0.8
  # HF parity in float32, as tests/models/test_hf.py: reordered float32 sums through 3 layers, logits of O(1).
  np.testing.assert_allclose(_ptx_logits(model, tokens), expected, atol=1e-4, rtol=0, err_msg=name)


def test_save_hf_loads_in_transformers_and_back_bit_exact(checkpoint, tmp_path):
  name, path, tokens, expected = checkpoint
  model = load_hf(path)
  save_hf(model, tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["model_type"] == "deepseek_v3" and config["rope_interleave"] and config["first_k_dense_replace"] == 1
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
  np.testing.assert_allclose(_hf_logits(reloaded.eval(), tokens), expected, atol=1e-4, rtol=0, err_msg=name)
  reloaded_ptx = load_hf(tmp_path)
  assert reloaded_ptx.cfg == model.cfg
  jax.tree.map(np.testing.assert_array_equal, reloaded_ptx.params, model.params)  # load -> save -> load: bit-exact
  from safetensors.numpy import load_file

  ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(path / "model.safetensors")
  assert ours.keys() == theirs.keys()
  for key in ours:  # the rotary rows re-interleaved: every tensor as transformers wrote it
    np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_sharded_load_matches_single_device(checkpoint):
  _, path, tokens, expected = checkpoint
  mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
  model = load_hf(path, mesh=mesh)
  for (where, array), sharding in zip(jax.tree_util.tree_leaves_with_path(model.params),
                                      jax.tree.leaves(param_shardings(model.cfg, mesh))):
    assert array.sharding == sharding, where
  kv_b = model.params["layers"]["kv_b"]
  assert kv_b.sharding.shard_shape(kv_b.shape)[2] == 8 // 4  # heads over tensor
  # Sharded vs HF: the same float32 reorderings as above.
  np.testing.assert_allclose(_ptx_logits(model, tokens), expected, atol=1e-4, rtol=0)


def test_unsupported_keys_are_refused(checkpoint, tmp_path):
  _, path, _, _ = checkpoint
  config = json.loads((path / "config.json").read_text())
  for change, message in (({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
                          ({"num_key_value_heads": 2}, "model.n_kv_heads must equal model.n_heads=8")):
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(hf_config.HFConfigError, match=message):
      load_hf(tmp_path)
