"""Ragged paged attention: each row's queries over the pages it holds, at a cost that follows the pages held.

K/V live in a pool of pages [P, KV, S, D] (S slots per page, heads before
slots so a page feeds the products with its batch dims major, no transpose).
The work is a flat list of Q (row, page) pairs: pair i says that page
pages[i] holds positions [index[i] * S, (index[i] + 1) * S) of row rows[i].
The pairs run in blocks of `block_pairs`: each block's pages are gathered
([block, KV, S, D], small enough to stay in cache: a gather of all Q pages at
once writes and re-reads a copy of every page, which on XLA:CPU cost 6x the
products), scored against their rows' queries, and folded into per-row
accumulators by an online softmax over segments (max, sum of exponentials,
weighted values per row). Rows of very different lengths cost
what their own pages do, not the longest row's: the flat list is as long as
the pages actually held, where a dense [B, S_max] view costs B times the
longest. Pairs are sorted by row; padding pairs name a position past every
row's length (index >= ceil(max length / S)), so they are masked out, and
the loop skips the blocks after the last pair below its row's length: padding
at the end of the list (a bucketed pair count) costs nothing.

Key slot s of pair i has position index[i] * S + s and is visible to query t
of row r = rows[i] iff it is below lengths[r] and, as in `mask.py`, causal
(q_position >= kv_position) and within the window. Float32 throughout; a row
with no visible key gets out 0 and lse -inf. A pool without values
(`v_pages` None) reads them as the first `values_width` columns of the keys:
multi-head latent attention's one latent per slot.

This loop ("xla") is the reference and the path off TPU/GPU; `impl` picks a
Pallas kernel of the same computation instead (`paged_pallas`).
"""

import jax
import jax.numpy as jnp

from ptx_kernels import implementation
from ptx_kernels import mask as mask_lib
from ptx_kernels import paged_pallas

IMPLS = ("auto", "xla", "pallas_gpu", "pallas_tpu")
# Up to this many blocks of pairs run unrolled: on XLA:CPU each iteration of a while loop costs a fixed
# overhead that a short decode call's attention (a few blocks) pays several times over.
UNROLLED_BLOCKS = 4


def _choose(impl: str, interpret: bool) -> implementation.Kernel:
  """The kernel `impl` names, by `implementation.choose`'s rules; its pure-JAX "blockwise" is this module's "xla"."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  return implementation.choose("blockwise" if impl == "xla" else impl, interpret, portable="xla")


def paged_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array | None, *, rows: jax.Array, pages: jax.Array,
    index: jax.Array, lengths: jax.Array, q_positions: jax.Array, causal: bool = True, window=None,
    softcap: float | None = None, scale: float | None = None, block_pairs: int | None = None,
    impl: str = "xla", interpret: bool = False, k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
    values_width: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Attention of T queries per row over the pages its (row, page) pairs name.

  Args:
    q: queries [R, T, H, D].
    k_pages: the key pool [P, KV, S, D].
    v_pages: the value pool [P, KV, S, Dv]; None: the values are the first
      `values_width` columns of the keys ("xla" only; `v_scales` None).
    rows: int32 [Q] the row of each pair, ascending.
    pages: int32 [Q] the page of each pair.
    index: int32 [Q] which page of its row the pair's page is (its first
      position over S).
    lengths: int32 [R] positions of each row that hold keys (the new
      tokens' included).
    q_positions: int32 [R, T] the queries' positions.
    causal, window, softcap, scale: as in `flash_attention`.
    block_pairs: pairs per block of the "xla" loop; default about 1 MiB of
      keys. The Pallas kernels take one pair per step.
    impl: "xla" (this module's pure-JAX loop, any backend), "pallas_tpu"
      (Mosaic kernel), "pallas_gpu" (Triton-style kernel; head dims and the
      page size powers of two >= 16) or "auto": the default backend's Pallas
      kernel on TPU or GPU, "xla" elsewhere (`paged_pallas`).
    interpret: run a Pallas kernel through the Pallas interpreter (on CPU).
    k_scales, v_scales: float32 [P, KV, S] per-slot, per-head scales of
      int8 pools (x ~ values * scale; "xla" only), or None for pools in a
      float dtype.
    values_width: Dv of a pool without values (`v_pages` None).

  Returns:
    (out [R, T, H, Dv] in q.dtype, lse [R, H, T] float32).

  Raises:
    ValueError: for shapes that do not fit together, an unknown impl, a
      Pallas kernel the default backend cannot run uninterpreted, or shapes
      the chosen kernel cannot tile.
  """
  kernel = _choose(impl, interpret)
  q, k_pages, lengths, q_positions = map(jnp.asarray, (q, k_pages, lengths, q_positions))
  v_pages = None if v_pages is None else jnp.asarray(v_pages)
  r, t, h, d = q.shape
  kvh = k_pages.shape[1]
  if v_pages is None:
    mask_lib.check_values_width(values_width, d)
  values_width = values_width if v_pages is None else None
  v_shape = k_pages.shape[:3] if v_pages is None else v_pages.shape[:3]
  if q.shape[3] != k_pages.shape[3] or h % kvh or k_pages.shape[:3] != v_shape:
    raise ValueError(f"q {q.shape}, k_pages {k_pages.shape} and v_pages {v_shape} do not fit together")
  scale_shapes = {x.shape for x in (k_scales, v_scales) if x is not None}
  paired = v_scales is None if v_pages is None else (k_scales is None) == (v_scales is None)
  if not paired or scale_shapes - {k_pages.shape[:3]}:
    raise ValueError(f"k_scales and v_scales must both be None or float32 {k_pages.shape[:3]} (v_scales None for a "
                     "pool without values)")
  window = mask_lib.check_window(window)
  scale = d ** -0.5 if scale is None else scale
  args = (q, k_pages, v_pages, rows, pages, index, lengths, q_positions)
  if kernel.name in implementation.PALLAS:
    if k_scales is not None or v_pages is None:
      raise ValueError(f"int8 pages (k_scales, v_scales) and pools without values (v_pages None) are read by "
                       f"impl='xla' only, not {kernel.name!r}")
    paged_pallas.check(kernel, q, k_pages, v_pages)
    return paged_pallas.attention(*args, causal=causal, window=window, softcap=softcap, scale=scale, kernel=kernel)
  return _segments(*args, k_scales, v_scales, causal=causal, window=window, softcap=softcap, scale=scale,
                   block_pairs=block_pairs, values_width=values_width)


def _segments(q, k_pages, v_pages, rows, pages, index, lengths, q_positions, k_scales, v_scales, *, causal, window,
              softcap, scale, block_pairs, values_width):
  """The "xla" path: blocks of pairs folded into per-row accumulators by a segment softmax."""
  r, t, h, d = q.shape
  _, kvh, s, _ = k_pages.shape
  g = h // kvh
  n = rows.shape[0]
  block = min(n, block_pairs or max(1, (1 << 18) // (kvh * s * d)))
  n_blocks = -(-n // block)
  # Padding pairs: the last row (the order stays sorted), the first page, positions no row reaches.
  pad = n_blocks * block - n
  rows = jnp.pad(rows, (0, pad), constant_values=r - 1)
  pages = jnp.pad(pages, (0, pad))
  index = jnp.pad(index, (0, pad), constant_values=jnp.iinfo(jnp.int32).max // s - 1)
  q_RKGTD = q.reshape(r, t, kvh, g, d).transpose(0, 2, 3, 1, 4).astype(jnp.float32)
  segments = dict(num_segments=r, indices_are_sorted=True)

  def fold(i, carry):
    m, l, acc = carry
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, i * block, block)  # noqa: E731
    rows_b, pages_b, index_b = take(rows), take(pages), take(index)
    k_BKSD = k_pages[pages_b].astype(jnp.float32)
    if k_scales is not None:  # int8 pages: dequantised as they are read
      k_BKSD = k_BKSD * k_scales[pages_b][..., None]
    if v_pages is None:  # a latent pool: the values lead the keys
      v_BKSD = k_BKSD[..., :values_width]
    else:
      v_BKSD = v_pages[pages_b].astype(jnp.float32)
      if v_scales is not None:
        v_BKSD = v_BKSD * v_scales[pages_b][..., None]
    scores = jnp.einsum("bkgtd,bksd->bkgts", q_RKGTD[rows_b], k_BKSD) * scale
    if softcap is not None:
      scores = softcap * jnp.tanh(scores / softcap)
    kv_pos_BS = index_b[:, None] * s + jnp.arange(s, dtype=jnp.int32)[None]
    dist_BTS = q_positions[rows_b][:, :, None] - kv_pos_BS[:, None, :]
    ok = (kv_pos_BS < lengths[rows_b][:, None])[:, None, :]
    if causal:
      ok &= dist_BTS >= 0
    if window is not None:
      ok &= dist_BTS < window
    scores = jnp.where(ok[:, None, None], scores, -jnp.inf)
    m_new = jnp.maximum(m, jax.ops.segment_max(jnp.max(scores, axis=-1), rows_b, **segments))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(scores - m_safe[rows_b][..., None])
    decay = jnp.exp(m - m_safe)
    l = l * decay + jax.ops.segment_sum(jnp.sum(p, axis=-1), rows_b, **segments)
    pv = jax.ops.segment_sum(jnp.einsum("bkgts,bksd->bkgtd", p, v_BKSD), rows_b, **segments)
    return m_new, l, acc * decay[..., None] + pv

  init = (jnp.full((r, kvh, g, t), -jnp.inf, jnp.float32), jnp.zeros((r, kvh, g, t), jnp.float32),
          jnp.zeros((r, kvh, g, t, values_width or v_pages.shape[-1]), jnp.float32))
  if n_blocks <= UNROLLED_BLOCKS:
    carry = init
    for i in range(n_blocks):
      carry = fold(i, carry)
    m, l, acc = carry
  else:
    # The loop stops after the last block holding a pair with a key below its row's length: every score of a later
    # block is masked, so it would change nothing (its max is -inf, its decay 1, its sums 0). A pair list padded to
    # a power-of-two bucket then costs its real pairs, not up to twice as many.
    seen = index * s < lengths[rows]
    live_blocks = jnp.max(jnp.where(seen, jnp.arange(n_blocks * block, dtype=jnp.int32), -1)) // block + 1
    m, l, acc = jax.lax.fori_loop(0, live_blocks, fold, init)
  safe = jnp.where(l > 0, l, 1.0)
  out = (acc / safe[..., None]).transpose(0, 3, 1, 2, 4).reshape(r, t, h, -1)
  lse = jnp.where(l > 0, m + jnp.log(safe), -jnp.inf).reshape(r, h, t)
  return out.astype(q.dtype), lse
