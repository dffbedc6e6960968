"""The XLA:CPU workarounds switch: every site reads it, and turning it off changes no result."""

import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import ptx_kernels as pk
import pytest
from ptx_kernels import xla_cpu_workarounds

from ptx.config import SamplingConfig
from ptx.models import decoder, init_params, kv_cache
from ptx.sampling import generate, rules
from ptx.sampling import generation as generation_lib

TILES = pk.BlockSizes(block_q=8, block_kv=8)
PROMPTS = [[5, 17, 9], [200, 3, 3, 41, 7, 90, 11], [12], [64, 65]]


def _on_and_off(fn):
  """fn() with the workarounds on, then off."""
  with xla_cpu_workarounds.override(True):
    on = fn()
  with xla_cpu_workarounds.override(False):
    off = fn()
  return on, off


def _assert_trees_close(got, want, tol):
  """Every leaf of got within tol of want's, relative or absolute, compared in float32."""
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                       rtol=tol, atol=tol), got, want)


@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("0", False), ("off", None)])
def test_the_environment_variable_sets_the_switch(value, enabled):
  env = {k: v for k, v in os.environ.items() if k != xla_cpu_workarounds.ENV_VAR}
  if value is not None:
    env[xla_cpu_workarounds.ENV_VAR] = value
  run = subprocess.run([sys.executable, "-c", "from ptx_kernels import xla_cpu_workarounds as w; print(w.enabled())"],
                       env=env, capture_output=True, text=True, check=False)
  if enabled is None:
    assert run.returncode != 0 and "must be 0 or 1" in run.stderr
  else:
    assert run.returncode == 0 and run.stdout.strip() == str(enabled), run.stderr


def test_override_restores_the_setting_and_retraces():
  before = xla_cpu_workarounds.enabled()
  cumsum = jax.jit(rules._cumsum)
  x = jnp.ones((2, 100))
  on, off = _on_and_off(lambda: (xla_cpu_workarounds.active(), cumsum.lower(x).as_text()))
  assert on[0] and not off[0]
  assert on[1] != off[1]  # the same jit object traced again under the other setting
  assert xla_cpu_workarounds.enabled() == before


# Sites: each lowers differently with the switch on and off.


def test_rope_conditional_only_with_the_switch_on_and_only_for_cpu(tiny_config):
  layer_rope = jax.jit(decoder.layer_rope, static_argnums=1)
  positions = jnp.zeros((2, 8), jnp.int32)
  on, off = _on_and_off(lambda: layer_rope.lower(positions, tiny_config).as_text())
  # The conditional's predicate, any(positions != 0), is the only comparison.
  assert "stablehlo.compare" in on and "stablehlo.case" not in off and "stablehlo.compare" not in off
  with xla_cpu_workarounds.override(True):
    cuda = jax.export.export(layer_rope, platforms=["cuda"])(positions, tiny_config).mlir_module()
  assert "stablehlo.compare" not in cuda


def test_cumulative_sums_are_a_scan_only_with_the_switch_on():
  lowered = lambda: jax.jit(rules.invert_cdf).lower(jnp.full((2, 100), 0.01), jnp.zeros(2)).as_text()  # noqa: E731
  on, off = _on_and_off(lowered)
  assert "reduce_window" not in on and "reduce_window" in off


def test_blockwise_bf16_loop_barrier_and_tile_writes_only_with_the_switch_on():
  q = jnp.ones((1, 32, 2, 8), jnp.bfloat16)
  attend = jax.jit(lambda q: pk.flash_attention(q, q, q, block_sizes=TILES))
  on, off = _on_and_off(lambda: attend.lower(q).as_text())
  # `_tie`'s barrier stays either way; the loops' barriers and the uint16 tile writes go.
  assert on.count("optimization_barrier") > off.count("optimization_barrier") >= 1
  assert "ui16" in on and "ui16" not in off


def test_ring_sends_bf16_as_bits_only_with_the_switch_on():
  mesh = jax.make_mesh((1, 1, 1, 8), ("data", "fsdp", "tensor", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 4)
  q = jnp.ones((1, 64, 2, 8), jnp.bfloat16)
  ring = jax.jit(lambda q: pk.ring_attention(q, q, q, mesh=mesh, block_sizes=TILES))
  on, off = _on_and_off(lambda: ring.lower(q).as_text())
  # The K/V shards' permutes, by their operand type (segment ids and positions travel as int32 either way).
  permuted = lambda text: set(re.findall(r"collective_permute.*-> tensor<[\dx]*x(\w+)>", text))  # noqa: E731
  assert permuted(on) == {"ui16", "i32"} and permuted(off) == {"bf16", "i32"}


def test_decode_reads_the_whole_cache_in_one_block_and_phases_only_with_the_switch_on(tiny_config):
  cfg = tiny_config
  cache = kv_cache.init_cache(cfg, 2, 2 * kv_cache.BLOCK_SLOTS)
  q = jnp.ones((2, 1, cfg.n_heads, cfg.head_dim))
  k = jnp.ones((2, 1, cfg.n_kv_heads, cfg.head_dim))

  def lowered():
    attend = lambda cache: kv_cache.attend(cache, 0, q, k, k, positions=jnp.zeros((2, 1), jnp.int32),  # noqa: E731
                                           window=None, softcap=None, scale=1.0)[0]
    return jax.jit(attend).lower(cache).as_text(), generation_lib._phase_slots(8, 40, 1)

  (on, phases_on), (off, phases_off) = _on_and_off(lowered)
  # Off, the kernel loops over the filled blocks of 512 slots; on, one block of 1024 needs no loop.
  assert "stablehlo.while" not in on and "stablehlo.while" in off
  assert phases_on == [24, 40, 47] and phases_off == [47]


# Results: the plain path computes the same numbers.


@pytest.mark.parametrize("impl, dtype, tol", [("xla", "float32", 1e-5), ("blockwise", "bfloat16", 1e-2)])
def test_model_forward_and_gradients_equal_without_the_workarounds(tiny_config, impl, dtype, tol):
  # Off, XLA:CPU may fuse and order reductions differently: float32 rounding, or a bfloat16 ulp (2 ** -8).
  cfg = dataclasses.replace(tiny_config, attention_impl=impl, compute_dtype=dtype, scan_layers=False)
  params = init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  loss = lambda p: (decoder.forward(p, tokens, cfg) ** 2).mean()  # noqa: E731
  on, off = _on_and_off(lambda: jax.jit(jax.value_and_grad(loss))(params))
  _assert_trees_close(off, on, tol)


def test_sampler_tokens_and_log_probs_equal_without_the_workarounds(tiny_config):
  params = init_params(tiny_config, jax.random.key(0))
  kwargs = dict(cfg=tiny_config, max_new_tokens=40, rng=jax.random.key(2))  # 40 tokens: three phases when on
  runs = lambda: (  # noqa: E731
      generate(params, PROMPTS, sampling=SamplingConfig(greedy=True), **kwargs),
      generate(params, PROMPTS, sampling=SamplingConfig(temperature=0.8, top_p=0.9), group_size=2,
               shared_prompts=True, **kwargs))
  on, off = _on_and_off(runs)
  for got, want in zip(off, on):
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    # One block over the cache or several: the softmax sums in another order.
    np.testing.assert_allclose(np.asarray(got.log_probs), np.asarray(want.log_probs), atol=1e-5)


def test_attention_kernels_equal_without_the_workarounds(helpers):
  q, k, v = helpers.make_qkv(3, 2, 64, 64, 4, 2, 16, jnp.bfloat16)
  mesh = jax.make_mesh((1, 1, 1, 8), ("data", "fsdp", "tensor", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 4)
  kernels = {"blockwise": lambda q, k, v: pk.flash_attention(q, k, v, block_sizes=TILES),
             "ring": lambda q, k, v: pk.ring_attention(q, k, v, mesh=mesh, block_sizes=TILES)}
  for name, kernel in kernels.items():
    on, off = _on_and_off(lambda kernel=kernel: helpers.outputs_and_grads(kernel, q, k, v))
    # The workarounds move bits, not values: the same float32 sums in the same order.
    jax.tree.map(lambda a, b, name=name: np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                                        np.asarray(b, np.float32), err_msg=name),
                 off, on)

