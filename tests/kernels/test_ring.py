"""Ring attention over 8 fake devices == reference with each per-hop kernel; the program is a real ring.

The Pallas kernels run interpreted: the GPU one through the generic interpreter on 8 devices, the TPU one
through the TPU interpreter (~100x slower) on a ring of 2 devices, whose 128-token shards fill one tile.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ptx_kernels as pk

N = 8
TILES = pk.BlockSizes(block_q=8, block_kv=8)


@pytest.fixture
def seq_mesh():
  return jax.make_mesh((1, 1, 1, N), ("data", "fsdp", "tensor", "seq"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)


def test_zigzag_round_trip_and_chunk_placement():
  x = jnp.arange(32)[None]
  z = pk.to_zigzag(x, 4)
  np.testing.assert_array_equal(z[0, :8], [0, 1, 2, 3, 28, 29, 30, 31])
  np.testing.assert_array_equal(pk.from_zigzag(z, 4), x)


@pytest.mark.parametrize("impl, shape, dims, layout, kw", [
    # dims (B, T, KV): 96 tokens are 12 or 24 per device, not a multiple of the 8-token tiles.
    ("blockwise", (1, 1, 2, 4), (2, 96, 2), "contiguous", dict(window=40, softcap=20.0)),
    ("blockwise", (1, 1, 1, 8), (2, 96, 1), "zigzag", dict()),
    ("blockwise", (2, 1, 1, 4), (2, 96, 1), "zigzag", dict(packed=True)),
    # 12 tokens per device: padded up to the GPU kernel's 16-row tiles.
    ("pallas_gpu", (1, 1, 1, 8), (2, 96, 2), "contiguous", dict(window=40, softcap=20.0)),
    ("pallas_gpu", (1, 1, 1, 8), (2, 96, 1), "zigzag", dict(packed=True, heads_per_pass=1)),
    ("pallas_tpu", (1, 1, 1, 2), (1, 256, 2), "zigzag", dict(packed=True, window=100)),
])
def test_matches_reference_fwd_and_grads(helpers, impl, shape, dims, layout, kw):
  (b, t, kvh), h, d, n = dims, 4, 16, shape[-1]
  q, k, v = helpers.make_qkv(11, b, t, t, h, kvh, d)
  mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor", "seq"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 4,
                       devices=jax.devices()[:int(np.prod(shape))])
  kw = dict(kw)
  per_pass = kw.pop("heads_per_pass", None)
  packed = kw.pop("packed", False)
  if packed:
    seg = helpers.ragged_segments(5, b, t)
    kw.update(q_segment_ids=seg, kv_segment_ids=seg)
  slow = functools.partial(pk.reference_attention, **kw)
  if layout == "zigzag":
    zz = lambda x: pk.to_zigzag(x, n)
    ring_kw = {name: zz(x) if name.endswith("segment_ids") else x for name, x in kw.items()}
    if packed:  # Explicit positions; the unpacked case uses the defaults.
      pos = zz(jnp.broadcast_to(jnp.arange(t), (b, t)))
      ring_kw.update(q_positions=pos, kv_positions=pos)
    unzz = lambda x, axis=1: pk.from_zigzag(x, n, axis)
  else:
    ring_kw, unzz = kw, lambda x, axis=1: x
  ring = functools.partial(pk.ring_attention, mesh=mesh, layout=layout,
                           block_sizes=TILES, impl=impl, interpret=impl != "blockwise",
                           heads_per_pass=per_pass, **ring_kw)

  def fast(q, k, v):
    # Compare in natural order: the layout is undone inside the program.
    zq, zk, zv = (zz(x) for x in (q, k, v)) if layout == "zigzag" else (q, k, v)
    out, lse = ring(zq, zk, zv)
    return unzz(out), unzz(lse, 2)

  helpers.assert_matches(fast, slow, q, k, v)


@pytest.mark.parametrize("heads_per_pass", [1, 4])
def test_head_passes_match_reference(helpers, seq_mesh, heads_per_pass):
  # 8 q heads over 2 kv heads: 1 q head per pass splits a kv head's group over
  # four rings; 4 is one kv head per pass (the default).
  b, t, h, kvh, d = 1, 64, 8, 2, 8
  q, k, v = helpers.make_qkv(3, b, t, t, h, kvh, d)
  ring = functools.partial(pk.ring_attention, mesh=seq_mesh, block_sizes=TILES,
                           heads_per_pass=heads_per_pass)
  helpers.assert_matches(ring, pk.reference_attention, q, k, v)


def test_heads_per_pass_must_fit_the_groups(seq_mesh):
  x, kv = jnp.zeros((1, 16, 8, 4)), jnp.zeros((1, 16, 2, 4))
  with pytest.raises(ValueError, match="heads_per_pass=3"):
    pk.ring_attention(x, kv, kv, mesh=seq_mesh, heads_per_pass=3)


def test_compiled_program_is_a_ring(helpers, seq_mesh):
  b, t = 1, 256
  shard = NamedSharding(seq_mesh, P(None, "seq"))
  q, k, v = (jax.device_put(x, shard) for x in helpers.make_qkv(0, b, t, t, 4, 2, 16))
  fast = functools.partial(pk.ring_attention, mesh=seq_mesh, layout="zigzag",
                           block_sizes=TILES)
  fwd = jax.jit(fast)
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fast(q, k, v)[0]), (0, 1, 2)))
  for program in (fwd, grad):
    text = program.lower(q, k, v).compile().as_text()
    assert "collective-permute" in text
    assert "all-gather" not in text and "all-to-all" not in text
  out, lse = fwd(q, k, v)
  seq_sharded = lambda x, spec: x.sharding.is_equivalent_to(
      NamedSharding(seq_mesh, spec), x.ndim)
  assert seq_sharded(out, P(None, "seq"))
  assert seq_sharded(lse, P(None, None, "seq"))
  assert all(seq_sharded(g, P(None, "seq")) for g in grad(q, k, v))


def test_invalid_ring_inputs_raise(seq_mesh):
  x = jnp.zeros((1, 24, 2, 4))
  with pytest.raises(ValueError, match="split evenly"):
    pk.ring_attention(x, x, x, mesh=seq_mesh, layout="zigzag")
  with pytest.raises(ValueError, match="layout"):
    pk.ring_attention(x, x, x, mesh=seq_mesh, layout="striped")
  with pytest.raises(ValueError, match="lack"):
    pk.ring_attention(x, x, x, mesh=seq_mesh, axis_name="sp")
  with pytest.raises(ValueError, match=r"head_dim a power of two >= 16, got 4 \(q \(1, 24, 2, 4\)"):
    pk.ring_attention(x, x, x, mesh=seq_mesh, impl="pallas_gpu", interpret=True)
  with pytest.raises(ValueError, match="runs on a GPU"):
    pk.ring_attention(x, x, x, mesh=seq_mesh, impl="pallas_gpu")
