"""The candidate Pallas GPU kernel's tile runs (benchmarks/candidates/pallas_gpu_tile_runs.py): 15da255's test.

Its correctness against the reference, interpreted, is the device check's smoke run (`tile_runs` section); this pins
which tiles each tile loops over, which correctness cannot see (a run too long computes masked tiles for nothing).
It goes back to tests/kernels/test_pallas_gpu.py with the kernel if the kernel is promoted.
"""

import jax.numpy as jnp
from ptx_kernels import blockwise
from ptx_kernels import mask as mask_lib


def test_each_tile_loops_over_the_run_of_tiles_it_may_see(import_benchmark):
  """Causal: query tile i loops over key tiles [0, 2(i + 1)) of 16 (tiles of 32 and 16), key tile j over query
  tiles [j // 2, 4); a window narrows both runs, packing cuts them at documents, padding empties them."""
  tile_runs = import_benchmark("candidates.pallas_gpu_tile_runs")

  def runs(causal=True, window=None, seg=None):
    seg = jnp.ones((1, 128), jnp.int32) if seg is None else seg
    mi = mask_lib.make_mask_inputs(1, 128, 128, q_segment_ids=seg, kv_segment_ids=seg, window=window)
    st = blockwise.Static(block_q=32, block_kv=16, causal=causal, softcap=None, scale=1.0)
    lo, hi = mask_lib.key_bounds(mi, causal)
    return [x[0].tolist() for x in tile_runs._runs(mi, lo, hi, st)]

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
