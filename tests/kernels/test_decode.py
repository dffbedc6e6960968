"""Decode attention over a KV cache (split and seq-sharded) == reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ptx_kernels as pk

B, S, H, KV, D = 3, 256, 8, 2, 16
LENGTHS = jnp.array([5, 200, 37], jnp.int32)


def _reference(q, k, v, lengths, **kw):
  t = q.shape[1]
  qpos = lengths[:, None] - t + jnp.arange(t)[None]
  valid = (jnp.arange(S)[None] < lengths[:, None]).astype(jnp.int32)
  return pk.reference_attention(
      q, k, v, q_positions=qpos, kv_positions=jnp.broadcast_to(jnp.arange(S), (B, S)),
      q_segment_ids=jnp.ones(qpos.shape, jnp.int32), kv_segment_ids=valid, **kw)


@pytest.fixture
def mesh():
  return jax.make_mesh((1, 1, 2, 4), ("data", "fsdp", "tensor", "seq"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)


@pytest.mark.parametrize("t, kw", [
    (1, dict()),
    (3, dict(window=20, softcap=5.0)),
])
@pytest.mark.parametrize("sharded", [False, True])
def test_matches_reference(helpers, mesh, t, kw, sharded):
  q, k, v = helpers.make_qkv(t, B, t, S, H, KV, D)
  fast = jax.jit(functools.partial(
      pk.decode_attention, block_kv=16, mesh=mesh if sharded else None, **kw))
  out, lse = fast(q, k, v, lengths=LENGTHS)
  ref_out, ref_lse = _reference(q, k, v, LENGTHS, **kw)
  assert helpers.rel_err(out, ref_out) < 1e-5
  assert helpers.rel_err(lse, ref_lse) < 1e-5


def test_bf16_cache(helpers):
  q, k, v = helpers.make_qkv(9, B, 1, S, H, KV, D, jnp.bfloat16)
  out, _ = pk.decode_attention(q, k, v, lengths=LENGTHS, block_kv=64)
  ref_out, _ = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), LENGTHS)
  assert out.dtype == jnp.bfloat16 and helpers.rel_err(out, ref_out) < 1e-2


def test_sharded_cache_is_never_gathered(helpers, mesh):
  q, k, v = helpers.make_qkv(0, B, 1, S, H, KV, D)
  cache = NamedSharding(mesh, P(None, "seq", "tensor"))
  k, v = jax.device_put(k, cache), jax.device_put(v, cache)
  text = jax.jit(functools.partial(pk.decode_attention, block_kv=16, mesh=mesh)).lower(
      q, k, v, lengths=LENGTHS).compile().as_text()
  gathers = [line for line in text.splitlines() if "all-gather(" in line]
  assert gathers, "partials are merged across the seq axis"
  assert not any(f",{S}," in line or f"[{B},{S}" in line for line in gathers)


def test_invalid_decode_inputs_raise(mesh):
  q, kv = jnp.zeros((B, 1, H, D)), jnp.zeros((B, S, KV, D))
  with pytest.raises(ValueError, match="lengths"):
    pk.decode_attention(q, kv, kv, lengths=jnp.zeros((B, 1), jnp.int32))
  with pytest.raises(ValueError, match="whole"):
    pk.decode_attention(q, kv, kv, lengths=LENGTHS, block_kv=48)
