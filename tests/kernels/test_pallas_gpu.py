"""GPU Pallas (Triton-style) flash attention, interpreted on CPU, == reference."""

import functools

import jax.numpy as jnp
import pytest

import ptx_kernels as pk

TILES = pk.BlockSizes(block_q=32, block_kv=16)


def _gpu(**kw):
  return functools.partial(pk.flash_attention, impl="pallas_gpu", interpret=True,
                           block_sizes=TILES, **kw)


@pytest.mark.parametrize("h, kv, kw", [
    (8, 2, dict(packed=True)),
    (8, 1, dict(window=9, softcap=7.5)),
    (4, 4, dict(causal=False)),
])
def test_matches_reference_f32(helpers, h, kv, kw):
  b, t, d = 2, 64, 16
  q, k, v = helpers.make_qkv(h * kv, b, t, t, h, kv, d)
  kw = dict(kw)
  if kw.pop("packed", False):
    seg = helpers.ragged_segments(1, b, t)
    kw.update(q_segment_ids=seg, kv_segment_ids=seg)
  helpers.assert_matches(_gpu(**kw), functools.partial(pk.reference_attention, **kw),
                         q, k, v)


def test_bf16_and_explicit_positions(helpers):
  q, k, v = helpers.make_qkv(3, 1, 32, 48, 8, 1, 32, jnp.bfloat16)
  pos = dict(q_positions=jnp.arange(16, 48)[None], kv_positions=jnp.arange(48)[None])
  helpers.assert_matches(_gpu(**pos), functools.partial(pk.reference_attention, **pos),
                         q, k, v, tol=1e-2)  # bfloat16: see assert_matches


def test_head_dim_must_suit_triton():
  x = jnp.zeros((1, 16, 1, 24))
  with pytest.raises(ValueError, match="power of two"):
    pk.flash_attention(x, x, x, impl="pallas_gpu", interpret=True)


def test_each_tile_loops_over_the_run_of_tiles_it_may_see():
  """Causal: query tile i loops over key tiles [0, 2(i + 1)) of 16 (tiles of 32 and 16), key tile j over query
  tiles [j // 2, 4); a window narrows both runs, packing cuts them at documents, padding empties them."""
  from ptx_kernels import blockwise
  from ptx_kernels import mask as mask_lib
  from ptx_kernels import pallas_gpu

  def runs(causal=True, window=None, seg=None):
    seg = jnp.ones((1, 128), jnp.int32) if seg is None else seg
    mi = mask_lib.make_mask_inputs(1, 128, 128, q_segment_ids=seg, kv_segment_ids=seg, window=window)
    st = blockwise.Static(block_q=32, block_kv=16, causal=causal, softcap=None, scale=1.0)
    lo, hi = mask_lib.key_bounds(mi, causal)
    return [x[0].tolist() for x in pallas_gpu._runs(mi, lo, hi, st)]

  assert runs() == [[0, 0, 0, 0], [2, 4, 6, 8], [0, 0, 1, 1, 2, 2, 3, 3], [4] * 8]
  assert runs(causal=False) == [[0] * 4, [8] * 4, [0] * 8, [4] * 8]
  # Keys at distance < 16 from each query: query tile i (32i..32i+31) sees keys 32i-15 .. 32i+31.
  assert runs(window=16)[:2] == [[0, 1, 3, 5], [2, 4, 6, 8]]
  # Two documents of 64 tokens: query tiles 2, 3 start at the second document's first key tile.
  seg = jnp.repeat(jnp.asarray([[1, 2]], jnp.int32), 64, axis=1)
  assert runs(seg=seg)[:2] == [[0, 0, 4, 4], [2, 4, 6, 8]]
  # Padding (segment 0) in the last 32 tokens: its query tile sees nothing, its key tiles are seen by none.
  seg = jnp.concatenate([jnp.ones((1, 96), jnp.int32), jnp.zeros((1, 32), jnp.int32)], axis=1)
  first, stop, kv_first, kv_stop = runs(seg=seg)
  assert (first[3], stop[3]) == (0, 0) and kv_stop[6:] == [0, 0] and kv_first[6:] == [0, 0]
