"""Ragged paged attention == the reference over each row's gathered pages: shared pages, empty rows, padding pairs."""

import jax.numpy as jnp
import numpy as np
import pytest

import ptx_kernels as pk

S, KV, H, D = 4, 2, 6, 8
# Float32 on both sides, the softmax merged across pages (segments) vs in one pass: a few ulps.
ATOL = 1e-5


def _case(seed=0):
  rng = np.random.default_rng(seed)
  k_pages, v_pages = (rng.normal(size=(12, KV, S, D)).astype(np.float32) for _ in range(2))
  # Row 0 holds pages 3, 5, 1; row 1 shares row 0's first two (a group's prompt) then its own 7; row 2 holds
  # nothing; row 3 one page. Lengths end mid-page.
  tables = [[3, 5, 1], [3, 5, 7], [], [9]]
  lengths = np.array([10, 11, 0, 2], np.int32)
  return rng, k_pages, v_pages, tables, lengths


def _pairs(tables, pad):
  rows = [r for r, t in enumerate(tables) for _ in t] + [len(tables) - 1] * pad
  pages = [p for t in tables for p in t] + [0] * pad
  index = [i for t in tables for i in range(len(t))] + [10 ** 6] * pad  # padding: past every length
  return (np.asarray(x, np.int32) for x in (rows, pages, index))


# block_pairs=2: the 12 pairs run as 6 blocks in a loop, a row's pages split across blocks (the online softmax
# across them); block_pairs=4: 3 blocks, unrolled (paged.UNROLLED_BLOCKS).
@pytest.mark.parametrize("t, kw", [(1, dict()), (3, dict(window=5, softcap=4.0)), (2, dict(block_pairs=2)),
                                   (2, dict(block_pairs=4))])
def test_matches_the_reference_over_gathered_pages(t, kw):
  rng, k_pages, v_pages, tables, lengths = _case()
  q = rng.normal(size=(4, t, H, D)).astype(np.float32)
  q_positions = np.maximum(lengths[:, None] - t + np.arange(t)[None], 0).astype(np.int32)
  rows, pages, index = _pairs(tables, pad=5)
  out, lse = pk.paged_attention(q, k_pages, v_pages, rows=rows, pages=pages, index=index, lengths=lengths,
                                q_positions=q_positions, **kw)
  width = 3 * S
  k_rows = np.zeros((4, width, KV, D), np.float32)
  v_rows = np.zeros_like(k_rows)
  for r, table in enumerate(tables):
    for i, page in enumerate(table):
      k_rows[r, i * S:(i + 1) * S] = k_pages[page].swapaxes(0, 1)
      v_rows[r, i * S:(i + 1) * S] = v_pages[page].swapaxes(0, 1)
  slots = np.broadcast_to(np.arange(width, dtype=np.int32), (4, width))
  expected, expected_lse = pk.reference_attention(
      jnp.asarray(q), jnp.asarray(k_rows), jnp.asarray(v_rows), q_positions=q_positions, kv_positions=slots,
      q_segment_ids=np.ones((4, t), np.int32), kv_segment_ids=(slots < lengths[:, None]).astype(np.int32),
      **{key: value for key, value in kw.items() if key != "block_pairs"})
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=ATOL, rtol=0)
  live = lengths > 0
  np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(expected_lse)[live], atol=ATOL, rtol=0)
  # A row with no pages sees no key: zeros and -inf, never NaN.
  assert np.all(np.asarray(out)[2] == 0) and np.all(np.isneginf(np.asarray(lse)[2]))


# block_pairs=2 runs the loop, which stops after the last block with a pair below its row's length: the padding
# blocks after it are skipped, and a last row's real pair after padding pairs (rows stay sorted) is still read.
@pytest.mark.parametrize("block_pairs", [None, 2])
def test_padding_pairs_and_page_order_change_nothing(block_pairs):
  rng, k_pages, v_pages, tables, lengths = _case(1)
  q = rng.normal(size=(4, 1, H, D)).astype(np.float32)
  q_positions = np.maximum(lengths - 1, 0)[:, None].astype(np.int32)
  args = dict(lengths=lengths, q_positions=q_positions, block_pairs=block_pairs)
  a = pk.paged_attention(q, k_pages, v_pages, **dict(zip(("rows", "pages", "index"), _pairs(tables, 0))), **args)
  b = pk.paged_attention(q, k_pages, v_pages, **dict(zip(("rows", "pages", "index"), _pairs(tables, 17))), **args)
  np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), atol=ATOL, rtol=0)
  rows, pages, index = (np.concatenate([x[:-1], np.full(9, pad, np.int32), x[-1:]])
                        for x, pad in zip(_pairs(tables, 0), (3, 0, 10 ** 6)))
  c = pk.paged_attention(q, k_pages, v_pages, rows=rows, pages=pages, index=index, **args)
  np.testing.assert_allclose(np.asarray(a[0]), np.asarray(c[0]), atol=ATOL, rtol=0)
  assert np.any(np.asarray(c[0])[3] != 0)  # the last row's one page, after the padding, was read


def test_mismatched_shapes_are_named():
  _, k_pages, v_pages, tables, lengths = _case()
  rows, pages, index = _pairs(tables, 0)
  with pytest.raises(ValueError, match="do not fit together"):
    pk.paged_attention(np.zeros((4, 1, 5, D), np.float32), k_pages, v_pages, rows=rows, pages=pages, index=index,
                       lengths=lengths, q_positions=np.zeros((4, 1), np.int32))


def test_int8_pages_read_as_their_dequantised_values():
  """Int8 pages with scales attend exactly as float pages holding values * scale (the product is in float32)."""
  rng, _, _, tables, lengths = _case(1)
  k8, v8 = (rng.integers(-127, 128, size=(12, KV, S, D)).astype(np.int8) for _ in range(2))
  k_scales, v_scales = (rng.uniform(0.001, 0.05, size=(12, KV, S)).astype(np.float32) for _ in range(2))
  q = rng.normal(size=(4, 2, H, D)).astype(np.float32)
  q_positions = np.maximum(lengths[:, None] - 2 + np.arange(2)[None], 0).astype(np.int32)
  rows, pages, index = _pairs(tables, pad=3)
  common = dict(rows=rows, pages=pages, index=index, lengths=lengths, q_positions=q_positions)
  out, lse = pk.paged_attention(q, k8, v8, k_scales=k_scales, v_scales=v_scales, **common)
  dequantised = [x.astype(np.float32) * s[..., None] for x, s in ((k8, k_scales), (v8, v_scales))]
  want, want_lse = pk.paged_attention(q, *dequantised, **common)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(lse)[lengths > 0], np.asarray(want_lse)[lengths > 0], atol=ATOL, rtol=0)
  with pytest.raises(ValueError, match="k_scales and v_scales must both be None"):
    pk.paged_attention(q, k8, v8, k_scales=k_scales, **common)
  with pytest.raises(ValueError, match="read by impl='xla' only"):
    pk.paged_attention(q, k8, v8, k_scales=k_scales, v_scales=v_scales, impl="pallas_gpu", interpret=True,
                       **common)


def test_a_pool_without_values_reads_them_as_the_keys_leading_columns():
  """MLA's latent pages: v_pages None attends exactly as a value pool holding the keys' first columns, int8 too."""
  rng, k_pages, _, tables, lengths = _case(2)
  k_pages = k_pages[:, :1]  # one latent head that every query head reads
  q = rng.normal(size=(4, 2, H, D)).astype(np.float32)
  q_positions = np.maximum(lengths[:, None] - 2 + np.arange(2)[None], 0).astype(np.int32)
  rows, pages, index = _pairs(tables, pad=1)
  common = dict(rows=rows, pages=pages, index=index, lengths=lengths, q_positions=q_positions, block_pairs=2)
  out, lse = pk.paged_attention(q, k_pages, None, values_width=5, **common)
  want, want_lse = pk.paged_attention(q, k_pages, k_pages[..., :5], **common)
  assert out.shape == (4, 2, H, 5)
  # The same values in the same order of sums: equal.
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
  k8 = rng.integers(-127, 128, size=k_pages.shape).astype(np.int8)
  scales = rng.uniform(0.001, 0.05, size=k_pages.shape[:3]).astype(np.float32)
  out8, _ = pk.paged_attention(q, k8, None, k_scales=scales, values_width=5, **common)
  dequantised = k8.astype(np.float32) * scales[..., None]
  want8, _ = pk.paged_attention(q, dequantised, dequantised[..., :5], **common)
  np.testing.assert_allclose(np.asarray(out8), np.asarray(want8), atol=ATOL, rtol=0)
  with pytest.raises(ValueError, match="values_width must be in .1, 8."):
    pk.paged_attention(q, k_pages, None, values_width=9, **common)
  with pytest.raises(ValueError, match="read by impl='xla' only"):
    pk.paged_attention(q, k_pages, None, values_width=5, impl="pallas_gpu", interpret=True, **common)
