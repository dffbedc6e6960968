"""Mixtures of Experts with dense layers among the MoE layers (`moe.dense_layers`): two stacks run in layer order."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_variants import moe_like
from scripted_episodes import MODEL
from ptx import sharding
from ptx.config import LoRAConfig
from ptx.models import decoder, kv_cache, lora, moe
from ptx.models.params import count_active_params, count_params, first_layers, init_params, param_specs
from ptx.models.rollout_params import rollout_params

# 4 layers: dense, MoE, dense, MoE (two runs of each stack, interleaved); and a DeepSeek-like dense first layer.
INTERLEAVED, PREFIX = (0, 2), (0,)


def _cfg(dense_layers, **kw):
  cfg = dataclasses.replace(moe_like(MODEL), n_layers=4, **kw)
  return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dense_layers=dense_layers))


def _reference(params, tokens, cfg):
  """Logits of the layers run one `decoder.block` at a time, each layer's weights picked from its stack by hand."""
  dense = cfg.moe.dense_layers
  moe_layers = [i for i in range(cfg.n_layers) if i not in dense]
  x = decoder.embed(params, tokens, cfg, sharding.DEFAULT_RULES)
  B, T = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  (sin, cos), _ = decoder.layer_rope(positions, cfg)
  for i in range(cfg.n_layers):
    stack, j = ("dense_layers", dense.index(i)) if i in dense else ("layers", moe_layers.index(i))
    layer = jax.tree.map(lambda w: w[j], params[stack])
    x, _, _ = decoder.block(layer, x, cfg, sin=sin, cos=cos, window=None, positions=positions,
                            segment_ids=jnp.ones((B, T), jnp.int32), rules=sharding.DEFAULT_RULES)
  return decoder.unembed(params, x, cfg, sharding.DEFAULT_RULES)


@pytest.mark.parametrize("dense_layers", [INTERLEAVED, PREFIX], ids=["interleaved", "prefix"])
def test_scanned_and_unrolled_stacks_run_the_layers_in_order(dense_layers):
  cfg = _cfg(dense_layers)
  params = init_params(cfg, jax.random.key(0))
  n_dense = len(dense_layers)
  assert params["dense_layers"]["gate"].shape == (n_dense, cfg.d_model, cfg.mlp_dim)
  assert params["layers"]["expert_gate"].shape[0] == cfg.n_moe_layers == cfg.n_layers - n_dense
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
  want = _reference(params, tokens, cfg)
  # float32, the same operations in the same order per layer: only XLA's fusion differs between the programs.
  for scan in (True, False):
    got = jax.jit(lambda p: decoder.forward(p, tokens, dataclasses.replace(cfg, scan_layers=scan)))(params)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"scan_layers={scan}")
  # Through a KV cache, token by token after a prefill (the sampler's path): the same logits.
  cache = kv_cache.init_cache(cfg, 2, 9)
  first, cache = decoder.forward_with_cache(params, tokens[:, :5], cfg, cache, positions=jnp.arange(5)[None] + 0 *
                                            tokens[:, :5])
  rest = [first]
  for t in range(5, 9):
    logits, cache = decoder.forward_with_cache(params, tokens[:, t:t + 1], cfg, cache,
                                               positions=jnp.full((2, 1), t, jnp.int32))
    rest.append(logits)
  np.testing.assert_allclose(jnp.concatenate(rest, axis=1), want, rtol=1e-5, atol=1e-5)


def test_routes_and_statistics_cover_the_moe_layers_only():
  cfg = _cfg(INTERLEAVED)
  params = init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, cfg.vocab_size)
  x, trace = decoder.hidden_states(params, tokens, cfg)
  assert trace.routes.shape == (2, 7, 2, cfg.moe.experts_per_token) and trace.routes.dtype == moe.ROUTE_DTYPE
  assert trace.stats["balance_loss"].shape == (2,)
  # Replaying the MoE layers' own routes changes nothing; replaying other experts changes the output.
  same, _ = decoder.hidden_states(params, tokens, cfg, routes=trace.routes)
  np.testing.assert_allclose(same, x, rtol=1e-6, atol=1e-6)
  other, replayed = decoder.hidden_states(params, tokens, cfg, routes=(trace.routes + 1) % cfg.moe.n_experts)
  np.testing.assert_array_equal(replayed.routes, (trace.routes + 1) % cfg.moe.n_experts)
  assert float(jnp.abs(other - x).max()) > 1e-3


def test_counts_cuts_int8_and_refusals():
  cfg = _cfg(INTERLEAVED)
  D, F, E, Fe, k = cfg.d_model, cfg.mlp_dim, cfg.moe.n_experts, cfg.moe.expert_mlp_dim, cfg.moe.experts_per_token
  uniform = _cfg(())
  # Two layers trade their experts, router and shared experts for the dense MLP.
  moe_mlp = E * 3 * D * Fe + D * E + E + 3 * D * cfg.moe.shared_mlp_dim
  assert count_params(cfg) == count_params(uniform) - 2 * moe_mlp + 2 * 3 * D * F
  assert count_active_params(cfg) == count_params(cfg) - 2 * (E - k) * 3 * D * Fe
  # A shallower model of the same kind keeps each stack's first layers.
  params = init_params(cfg, jax.random.key(0))
  shallow = dataclasses.replace(cfg, n_layers=3)
  cut = first_layers(params, shallow)
  assert jax.tree.map(jnp.shape, cut) == jax.tree.map(lambda s: s.shape, param_specs(shallow),
                                                      is_leaf=lambda s: hasattr(s, "logical_axes"))
  # Fast mode's int8 weights cover both stacks.
  rollout = rollout_params(params, cfg)
  assert all(type(rollout[stack]["q"]).__name__ == "QArray" for stack in ("layers", "dense_layers"))
  with pytest.raises(ValueError, match="dense_layers"):
    lora.adapter_specs(cfg, LoRAConfig(rank=4))
  for bad in ((4,), (2, 1), (0, 1, 2, 3)):
    with pytest.raises(ValueError, match="model.moe.dense_layers"):
      _cfg(bad)
  with pytest.raises(ValueError, match="model.moe.dense_layers"):
    dataclasses.replace(MODEL, moe=dataclasses.replace(moe_like(MODEL).moe, n_experts=0, dense_layers=(0,)))
