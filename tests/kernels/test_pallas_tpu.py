"""TPU Pallas (Mosaic) flash attention under the TPU interpreter == reference.

The TPU interpreter is ~100x slower than the generic one, so one small case
covers GQA, packing with padding rows, window and soft-cap together.
"""

import functools

import ptx_kernels as pk


def test_matches_reference_f32(helpers):
  b, t, h, kv, d = 1, 256, 4, 1, 64
  q, k, v = helpers.make_qkv(21, b, t, t, h, kv, d)
  seg = helpers.ragged_segments(2, b, t, max_docs=3)
  kw = dict(q_segment_ids=seg, kv_segment_ids=seg, window=100, softcap=20.0)
  fast = functools.partial(pk.flash_attention, impl="pallas_tpu", interpret=True,
                           block_sizes=pk.BlockSizes(128, 128), **kw)
  helpers.assert_matches(fast, functools.partial(pk.reference_attention, **kw),
                         q, k, v)
