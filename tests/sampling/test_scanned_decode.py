"""`model.decode_loop`: a decode step whose layers run under scans over stacked caches samples what the unrolled one
does, in `generate` and in the rollout engine (prefill and decode), for every cache kind and on a mesh."""

import dataclasses

import jax
import numpy as np
from engine_setup import GREEDY, perturbed_params

from model_variants import gemma_like, mla_like, moe_like
from ptx.config import MeshConfig
from ptx.models import kv_cache, paged_kv_cache
from ptx.models.params import param_shardings
from ptx.sampling import generate
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sharding import make_mesh

PROMPTS = [[5, 17, 9, 44, 2], [200, 3, 3], [12, 64, 65, 7, 90, 11, 8, 31]]
N_NEW = 4
# Scanned and unrolled steps run the same float32 operations on the same operands, layer by layer: seen equal to
# the bit here (XLA:CPU at -O0). Another optimisation level may fuse the two programs apart and round a sum in
# another order: 1e-6 is 2 ulps of these log-probs (near -4, ulp 4.8e-7). Tokens are compared exactly.
SCAN_VS_UNROLL_ATOL = 1e-6
# Three short requests in pages of 4, each decoded in one call: one prefill and one decode shape per engine.
ENGINE = EngineConfig(max_seqs=4, pages=24, page_size=4, max_seq_len=16, decode_steps=4, prefill_chunk=8,
                      prefill_rows=2)


def _loops(cfg):
  """`cfg` with its decode step unrolled, and scanned."""
  return [dataclasses.replace(cfg, decode_loop=loop) for loop in ("unroll", "scan")]


def _variant(tiny_config, name):
  """The models: "mixed", grouped-query attention with Gemma's sliding windows on every other layer (the layers'
  windows and RoPE tables are scanned with them), soft-caps, sinks and Mixture-of-Experts MLPs; "mla", multi-head
  latent attention (one cached latent per slot, the values read out of it)."""
  mixed = dataclasses.replace(moe_like(gemma_like(tiny_config)), attention_sinks=True)
  return {"mixed": mixed, "mla": mla_like(tiny_config)}[name]


def _check(scanned_tokens, scanned_log_probs, unrolled_tokens, unrolled_log_probs, what):
  """Equal tokens, and log-probs within SCAN_VS_UNROLL_ATOL."""
  np.testing.assert_array_equal(np.asarray(scanned_tokens), np.asarray(unrolled_tokens), err_msg=what)
  np.testing.assert_allclose(np.asarray(scanned_log_probs), np.asarray(unrolled_log_probs), atol=SCAN_VS_UNROLL_ATOL,
                             rtol=0, err_msg=what)


def test_generate_scanned_equals_unrolled(tiny_config):
  """One call covers several caches at once: int8, whose groups of 2 rows share each prompt's K/V as a prefix."""
  unrolled_cfg, scanned_cfg = _loops(_variant(tiny_config, "mixed"))
  params = perturbed_params(unrolled_cfg)
  unrolled, scanned = (generate(params, PROMPTS, cfg=cfg, max_new_tokens=N_NEW, sampling=GREEDY, rng=jax.random.key(0),
                                kv_int8=True, group_size=2, shared_prompts=True) for cfg in (unrolled_cfg, scanned_cfg))
  _check(scanned.tokens, scanned.log_probs, unrolled.tokens, unrolled.log_probs, "generate")


def test_the_caches_hold_their_layers_as_the_decode_loop_runs_them(tiny_config):
  unrolled_cfg, scanned_cfg = _loops(tiny_config)
  L = tiny_config.n_layers
  per_layer, stacked = (kv_cache.init_cache(cfg, 2, 8, int8=True) for cfg in (unrolled_cfg, scanned_cfg))
  assert len(per_layer.k) == L and per_layer.k[0].shape == (2, 2, 8, 14) and not per_layer.stacked
  assert stacked.k.shape == stacked.v.shape == (L, 2, 2, 8, 14) and stacked.k_scale.shape == (L, 2, 2, 8)
  pools = [paged_kv_cache.init_pool(cfg, 6, 4, int8=True)[0] for cfg in (unrolled_cfg, scanned_cfg)]
  assert len(pools[0]) == L and pools[0][0].values.shape == (6, 2, 4, 14)
  assert pools[1].values.shape == (L, 6, 2, 4, 14) and pools[1].scales.shape == (L, 6, 2, 4)
  # "auto" scans wherever the backend is not XLA:CPU.
  assert not kv_cache.decode_scans(dataclasses.replace(tiny_config, decode_loop="auto"))
  # A stacked cache grows (the sampler's decode phases) and repeats (a group's copied prompts) as its layers do.
  keys = iter(jax.random.split(jax.random.key(0), 4 * L))
  filled = lambda arrays: tuple(jax.random.randint(next(keys), x.shape, -127, 128).astype(x.dtype)  # noqa: E731
                                for x in arrays)
  per_layer = dataclasses.replace(per_layer, k=filled(per_layer.k), v=filled(per_layer.v),
                                  k_scale=filled(per_layer.k_scale), v_scale=filled(per_layer.v_scale),
                                  starts=np.array([3, 0], np.int32))
  stacked = dataclasses.replace(per_layer, **{name: np.stack(getattr(per_layer, name))
                                              for name in ("k", "v", "k_scale", "v_scale")})
  for change in (lambda cache: kv_cache.grow(cache, 12), lambda cache: kv_cache.repeat(cache, 3)):
    want, got = change(per_layer), change(stacked)
    for name in ("k", "v", "k_scale", "v_scale"):
      np.testing.assert_array_equal(getattr(got, name), np.stack(getattr(want, name)), err_msg=name)
    np.testing.assert_array_equal(got.starts, want.starts)


def _engine_run(cfg, params, *, mesh=None, record_routes=False, **config):
  """Greedy completions of PROMPTS from an engine of ENGINE's shapes."""
  engine = RolloutEngine(cfg, dataclasses.replace(ENGINE, **config), sampling=GREEDY, mesh=mesh,
                         record_routes=record_routes)
  ids = [engine.submit(prompt, max_new_tokens=N_NEW)[0] for prompt in PROMPTS]
  done = engine.run(params)
  assert engine.allocator.in_use == 0
  return [done[i] for i in ids]


def test_engine_scanned_equals_unrolled(tiny_config):
  """Int8 pages, prefill and decode, and the experts of every token, traced by the scans as by the unrolled layers."""
  unrolled_cfg, scanned_cfg = _loops(_variant(tiny_config, "mixed"))
  params = perturbed_params(unrolled_cfg)
  unrolled, scanned = (_engine_run(cfg, params, record_routes=True, kv_dtype="int8")
                       for cfg in (unrolled_cfg, scanned_cfg))
  for row, (want, got) in enumerate(zip(unrolled, scanned)):
    _check(got.tokens, got.log_probs, want.tokens, want.log_probs, f"request {row}")
    np.testing.assert_array_equal(got.routes, want.routes, err_msg=f"request {row}")


def test_latent_caches_scanned_equal_unrolled_on_a_mesh(tiny_config):
  """MLA on data 2 x tensor 2 x seq 2: rows and int8 pages split over data, `generate`'s cache slots over seq (each
  device writes and reads its own, at the layer's index in the stack); the stacks' layer axis unsplit."""
  mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2, seq=2))
  unrolled_cfg, scanned_cfg = _loops(_variant(tiny_config, "mla"))
  placed = jax.device_put(perturbed_params(unrolled_cfg), param_shardings(unrolled_cfg, mesh))
  # Groups of 2 rows, each holding a copy of its prompt's latents.
  unrolled, scanned = (generate(placed, PROMPTS, cfg=cfg, max_new_tokens=N_NEW, sampling=GREEDY, rng=jax.random.key(0),
                                mesh=mesh, group_size=2, shared_prompts=False) for cfg in (unrolled_cfg, scanned_cfg))
  _check(scanned.tokens, scanned.log_probs, unrolled.tokens, unrolled.log_probs, "generate")
  unrolled, scanned = (_engine_run(cfg, placed, mesh=mesh, kv_dtype="int8") for cfg in (unrolled_cfg, scanned_cfg))
  for row, (want, got) in enumerate(zip(unrolled, scanned)):
    _check(got.tokens, got.log_probs, want.tokens, want.log_probs, f"engine request {row}")
