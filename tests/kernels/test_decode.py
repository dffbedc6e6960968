"""Decode attention over a KV cache (blocked, int8, seq-sharded) == reference; only filled blocks are read."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ptx_kernels as pk

B, S, H, KV, D = 3, 256, 8, 2, 16
LENGTHS = jnp.array([5, 200, 37], jnp.int32)
STARTS = jnp.array([0, 11, 30], jnp.int32)


def _reference(q, k, v, lengths, starts, **kw):
  t = q.shape[1]
  slots = jnp.arange(S)[None]
  qpos = (lengths - starts)[:, None] - t + jnp.arange(t)[None]
  valid = ((slots >= starts[:, None]) & (slots < lengths[:, None])).astype(jnp.int32)
  return pk.reference_attention(
      q, k, v, q_positions=qpos, kv_positions=slots - starts[:, None],
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
  # 24-slot blocks: the last block of each 64-slot shard overlaps its neighbour.
  fast = jax.jit(functools.partial(
      pk.decode_attention, block_kv=24, mesh=mesh if sharded else None, **kw))
  out, lse = fast(q, k, v, lengths=LENGTHS, starts=STARTS)
  ref_out, ref_lse = _reference(q, k, v, LENGTHS, STARTS, **kw)
  # Blocks of 24 slots (and seq shards merged through their log-sum-exps) vs one softmax: float32 sums in another
  # order, ~1e-6 of the scale; the same 1e-5 as tests/kernels/conftest.py's assert_matches.
  assert helpers.rel_err(out, ref_out) < 1e-5
  assert helpers.rel_err(lse, ref_lse) < 1e-5


@pytest.mark.parametrize("sharded", [False, True])
def test_a_cache_without_values_reads_them_as_the_keys_leading_columns(helpers, mesh, sharded):
  """MLA's latent cache: v_cache None attends as a value cache holding the keys' first columns, int8 included."""
  q, k, _ = helpers.make_qkv(5, B, 2, S, H, 1, D)  # one latent head that every query head reads
  # One head: tensor cannot split it (the model's cache passes the axes its KV spec has, none here).
  fast = jax.jit(functools.partial(pk.decode_attention, block_kv=24, mesh=mesh if sharded else None, head_axes=()),
                 static_argnames="values_width")
  out, lse = fast(q, k, None, lengths=LENGTHS, starts=STARTS, values_width=10)
  want, want_lse = fast(q, k, k[..., :10], lengths=LENGTHS, starts=STARTS)
  assert out.shape == (B, 2, H, 10)
  # The same values in the same order of sums: equal.
  assert jnp.array_equal(out, want) and jnp.array_equal(lse, want_lse)
  k8 = jax.random.randint(jax.random.key(6), k.shape, -127, 128).astype(jnp.int8)
  scale = jax.random.uniform(jax.random.key(7), k.shape[:3], minval=0.001, maxval=0.05)
  out8, _ = fast(q, k8, None, k_scale=scale, lengths=LENGTHS, starts=STARTS, values_width=10)
  dequantised = k8.astype(jnp.float32) * scale[..., None]
  # As test_int8_cache_dequantises_per_block: the product of the dequantised block, float32 rounding.
  assert helpers.rel_err(out8, fast(q, dequantised, dequantised[..., :10], lengths=LENGTHS, starts=STARTS)[0]) < 1e-5
  with pytest.raises(ValueError, match="values_width must be in .1, 16."):
    pk.decode_attention(q, k, None, lengths=LENGTHS, values_width=17)


def test_blocks_past_the_fill_are_never_read(helpers):
  # NaN beyond max(lengths) would poison any block that touched it.
  q, k, v = helpers.make_qkv(4, B, 1, S, H, KV, D)
  poisoned = lambda x: x.at[:, 208:].set(jnp.nan)  # noqa: E731
  out, _ = jax.jit(functools.partial(pk.decode_attention, block_kv=16))(
      q, poisoned(k), poisoned(v), lengths=LENGTHS, starts=STARTS)
  assert helpers.rel_err(out, _reference(q, k, v, LENGTHS, STARTS)[0]) < 1e-5  # as above


def test_int8_cache_dequantises_per_block(helpers):
  q, k, v = helpers.make_qkv(5, B, 1, S, H, KV, D)

  def quantize(x):
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    return jnp.round(x / scale[..., None]).astype(jnp.int8), scale

  (k8, ks), (v8, vs) = quantize(k), quantize(v)
  out, _ = pk.decode_attention(q, k8, v8, k_scale=ks, v_scale=vs, lengths=LENGTHS, starts=STARTS, block_kv=64)
  dequantized = (k8 * ks[..., None], v8 * vs[..., None])
  # Against the reference on the same dequantised values: only the blocks' order of the sums differs, as above.
  assert helpers.rel_err(out, _reference(q, *dequantized, LENGTHS, STARTS)[0]) < 1e-5


@pytest.mark.parametrize("sharded", [False, True])
def test_a_stacked_cache_attends_the_named_layer_and_comes_back_as_it_went_in(helpers, mesh, sharded):
  """layer=: every layer's int8 cache stacked [L, ...], the layer traced (as under a scan over the layers)."""
  layers = [helpers.make_qkv(seed, B, 2, S, H, KV, D)[1:] for seed in (11, 12, 13)]
  quantize = lambda x: (jnp.round(x / 0.02).astype(jnp.int8), jnp.full(x.shape[:3], 0.02))  # noqa: E731
  k8, ks, v8, vs = (jnp.stack(arrays) for arrays in zip(*[quantize(k) + quantize(v) for k, v in layers]))
  q = helpers.make_qkv(14, B, 2, S, H, KV, D)[0]
  call = jax.jit(functools.partial(pk.decode_attention, block_kv=24, return_cache=True, mesh=mesh if sharded else None,
                                   window=40, softcap=5.0))
  out, lse, cache = call(q, k8, v8, k_scale=ks, v_scale=vs, lengths=LENGTHS, starts=STARTS, layer=jnp.int32(1))
  want, want_lse = call(q, k8[1], v8[1], k_scale=ks[1], v_scale=vs[1], lengths=LENGTHS, starts=STARTS)[:2]
  # The same blocks in the same order of sums, read out of the stack rather than out of the layer's own array.
  assert jnp.array_equal(out, want) and jnp.array_equal(lse, want_lse)
  assert all(jnp.array_equal(x, y) for x, y in zip(cache, (k8, v8, ks, vs)))


def test_bf16_cache(helpers):
  q, k, v = helpers.make_qkv(9, B, 1, S, H, KV, D, jnp.bfloat16)
  out, _ = pk.decode_attention(q, k, v, lengths=LENGTHS, block_kv=64)
  ref_out, _ = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), LENGTHS, jnp.zeros((B,), jnp.int32))
  # A bfloat16 output keeps 8 mantissa bits (a rounding of 2^-9 = 0.2%), from bfloat16 inputs.
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
  with pytest.raises(ValueError, match="starts"):
    pk.decode_attention(q, kv, kv, lengths=LENGTHS, starts=jnp.zeros((B,), jnp.float32))
  with pytest.raises(ValueError, match="k_scale"):
    pk.decode_attention(q, kv, kv, lengths=LENGTHS, k_scale=jnp.ones((B, S, KV)))
  with pytest.raises(ValueError, match="shards"):
    pk.decode_attention(q, jnp.zeros((B, S - 2, KV, D)), jnp.zeros((B, S - 2, KV, D)), lengths=LENGTHS, mesh=mesh)
