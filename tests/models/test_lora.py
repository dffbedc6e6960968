"""LoRA as a tree transform: identity at init, merge == unmerged, sharding, PEFT export parity."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptx.config import LoRAConfig
from ptx.models import lora
from ptx.models.decoder import Decoder, forward
from ptx.models.params import init_params, param_shardings

LORA = LoRAConfig(rank=4, alpha=8.0)


def _tokens(cfg, batch=2, seq=11, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq)), jnp.int32)


def _trained_adapters(model, cfg, key, std=0.05):
  """Adapters with a non-zero B, as after some training."""
  adapters = lora.init_adapters(model, cfg, key)
  keys = iter(jax.random.split(jax.random.fold_in(key, 1), len(adapters)))
  return {name: {"a": ad["a"], "b": std * jax.random.normal(next(keys), ad["b"].shape)}
          for name, ad in adapters.items()}


_forward = jax.jit(forward, static_argnames="cfg")


def _lora_forward(base, adapters, tokens, *, model, cfg, rng=None):
  return forward(lora.apply(base, adapters, cfg, rng), tokens, model)


_lora_forward = jax.jit(_lora_forward, static_argnames=("model", "cfg"))


def test_fresh_adapters_give_the_base_logits_exactly(tiny_config, mesh):
  base = jax.jit(init_params, static_argnums=0, out_shardings=param_shardings(tiny_config, mesh))(
      tiny_config, jax.random.key(0))
  adapters = jax.jit(lora.init_adapters, static_argnums=(0, 1),
                     out_shardings=lora.adapter_shardings(tiny_config, LORA, mesh))(
                         tiny_config, LORA, jax.random.key(1))
  tokens = _tokens(tiny_config)
  with jax.set_mesh(mesh):
    expected = _forward(base, tokens, cfg=tiny_config)
    got = _lora_forward(base, adapters, tokens, model=tiny_config, cfg=LORA)
  # Exact by construction: with B = 0 the adapter path adds exact zeros to the same base matmuls.
  np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  assert all(float(jnp.abs(ad["a"]).max()) > 0 for ad in adapters.values())  # only B starts at zero


def test_merged_equals_unmerged_and_unmerge_restores_the_base(tiny_config):
  base = init_params(tiny_config, jax.random.key(0))
  cfg = dataclasses.replace(LORA, targets=("q", "v", "o", "down"))
  adapters = _trained_adapters(tiny_config, cfg, jax.random.key(2))
  tokens = _tokens(tiny_config)
  unmerged = _lora_forward(base, adapters, tokens, model=tiny_config, cfg=cfg)
  merged_params = lora.merge(base, adapters, cfg)
  merged = _forward(merged_params, tokens, cfg=tiny_config)
  # x (W + s A B) vs x W + s (x A) B: reassociated float32 products through 3 layers, logits O(1) (seen 12%).
  np.testing.assert_allclose(np.asarray(merged), np.asarray(unmerged), atol=1e-5, rtol=0)
  assert float(jnp.abs(merged - _forward(base, tokens, cfg=tiny_config)).max()) > 1e-2  # adapters matter
  restored = lora.unmerge(merged_params, adapters, cfg)
  # (W + s A B) - s A B rounds once each way: an ulp or two of entries ~0.1 (~1e-8), well inside 1e-6.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6), restored, base)


def test_adapters_are_sharded_like_their_weights_with_the_rank_replicated(tiny_config, mesh):
  specs = lora.adapter_specs(tiny_config, LORA)
  assert specs["q"]["a"].logical_axes == ("layers", "embed", "lora_rank")
  assert specs["q"]["b"].logical_axes == ("layers", "lora_rank", "heads", "head_dim")
  assert specs["o"]["a"].shape == (3, 8, 14, 4) and specs["o"]["b"].shape == (3, 4, 40)
  assert specs["down"]["a"].logical_axes == ("layers", "mlp", "lora_rank")
  weights, adapters = param_shardings(tiny_config, mesh)["layers"], lora.adapter_shardings(tiny_config, LORA, mesh)
  for name, n_in in lora.INPUT_AXES.items():
    w = tuple(weights[name].spec) + (None,) * 4
    a, b = tuple(adapters[name]["a"].spec) + (None,) * 4, tuple(adapters[name]["b"].spec) + (None,) * 4
    assert a[:1 + n_in] == w[:1 + n_in] and a[1 + n_in] is None, name
    assert b[1] is None and b[2:4] == w[1 + n_in:3 + n_in], name
  assert adapters["q"]["b"].spec[2] == "tensor" and adapters["down"]["a"].spec[1] == "tensor"


def test_dropout_needs_a_key_and_varies_with_it(tiny_config):
  base = init_params(tiny_config, jax.random.key(0))
  cfg = dataclasses.replace(LORA, dropout=0.5)
  adapters = _trained_adapters(tiny_config, cfg, jax.random.key(3))
  tokens = _tokens(tiny_config)
  no_key = _lora_forward(base, adapters, tokens, model=tiny_config, cfg=cfg)
  no_dropout = _lora_forward(base, adapters, tokens, model=tiny_config, cfg=dataclasses.replace(cfg, dropout=0.0))
  np.testing.assert_array_equal(np.asarray(no_key), np.asarray(no_dropout))
  one = _lora_forward(base, adapters, tokens, model=tiny_config, cfg=cfg, rng=jax.random.key(0))
  two = _lora_forward(base, adapters, tokens, model=tiny_config, cfg=cfg, rng=jax.random.key(1))
  assert float(jnp.abs(one - no_key).max()) > 1e-3 and float(jnp.abs(one - two).max()) > 1e-3


def test_project_matches_a_dense_einsum_of_the_merged_weight():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, 5, 6)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(5, 6, 7)), jnp.float32)
  a, b = jnp.asarray(rng.normal(size=(5, 6, 2)), jnp.float32), jnp.asarray(rng.normal(size=(2, 7)), jnp.float32)
  got = lora.project("bthk,hkd->btd", x, lora.LoRAWeight(w, a, b, None, scale=0.5, dropout=0.0), jnp.float32)
  expected = jnp.einsum("bthk,hkd->btd", x, w + 0.5 * jnp.einsum("hkr,rd->hkd", a, b))
  # Reassociated products of N(0, 1) inputs over 30 terms: outputs up to ~10, whose ulp is ~1e-6 (seen 1%).
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_peft_loads_the_exported_adapter_and_matches(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  from ptx.models import load_hf, save_hf
  from ptx.models.peft_export import save_peft

  config = transformers.LlamaConfig(vocab_size=264, hidden_size=40, intermediate_size=96, num_hidden_layers=3,
                                    num_attention_heads=8, num_key_value_heads=2, head_dim=14, rms_norm_eps=1e-6)
  torch.manual_seed(0)
  hf_model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():  # larger weights than the default init, so logits are O(1) and errors show
    for p in hf_model.parameters():
      p.copy_(torch.randn_like(p) * 0.2)
  hf_model.save_pretrained(tmp_path / "base")
  model = load_hf(tmp_path / "base")
  cfg = LoRAConfig(rank=4, alpha=12.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
  adapters = _trained_adapters(model.cfg, cfg, jax.random.key(5), std=0.2)
  save_peft(adapters, tmp_path / "adapter", model=model.cfg, lora=cfg,
            base_model_name_or_path=str(tmp_path / "base"))
  tokens = _tokens(model.cfg, seq=13)
  ours = np.asarray(_lora_forward(model.params, adapters, tokens, model=model.cfg, cfg=cfg))

  peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
  with torch.no_grad():
    theirs = peft_model(torch.tensor(np.asarray(tokens))).logits.float().numpy()
  # The reference's own precision: torch's float32 kernels sum in their own order over 3 layers (HF parity: 1e-4).
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
  assert np.abs(ours - np.asarray(_forward(model.params, tokens, cfg=model.cfg))).max() > 1e-2

  # The merged export is a plain HF model with the same logits.
  save_hf(Decoder(model.cfg, params=lora.merge(model.params, adapters, cfg)), tmp_path / "merged")
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  with torch.no_grad():
    merged_logits = merged(torch.tensor(np.asarray(tokens))).logits.float().numpy()
  np.testing.assert_allclose(merged_logits, theirs, atol=1e-4, rtol=0)  # as above, merged vs unmerged in torch


def test_adapted_weights_unstack_like_plain_ones(tiny_config):
  """The KV-cache path unrolls layers by slicing every leaf; adapted weights slice too."""
  from ptx.models.decoder import unstack_layers

  base = init_params(tiny_config, jax.random.key(0))
  adapters = _trained_adapters(tiny_config, LORA, jax.random.key(4))
  layers = unstack_layers(lora.apply(base, adapters, LORA), tiny_config)["layers"]
  assert isinstance(layers[1]["q"], lora.LoRAWeight) and layers[1]["q"].a.shape == (40, 4)
