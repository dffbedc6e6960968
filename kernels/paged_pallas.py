"""Ragged paged attention as Pallas kernels for TPU (Mosaic) and GPU (Triton-style), forward only.

Both compute what `paged.paged_attention` computes from the same (row, page,
index) pairs, sorted by row, over the pool [P, KV, S, D]:
  TPU  grid (KV, Q), pairs "arbitrary": the pairs (scalar-prefetched into
       SMEM) pick each step's page of the pool and its row's query, bounds
       and output blocks. Consecutive steps of one row revisit its output
       block, so an online softmax in VMEM scratch runs over the row's pairs,
       starting at its first pair and written out at its last. Rows without
       pairs are never visited and are filled with 0 / -inf afterwards.
  GPU  grid (R, KV, M/bm) of independent programs: each loops over its row's
       pairs [start, end) (from the sorted rows) and loads their pages from
       the pool by index.
A program's queries are the G query heads of one kv head times the T queries
of one row, flattened g-major into M = G * T rows padded to a power of two
>= 16 (Triton's dot tiles; padded queries see nothing). Visibility arrives
per query as a key-position interval (lo, hi] (`mask.key_bounds`, with hi
also below the row's length), so pairs past a row's length (padding) and
windows need no further data; a page no query of its row can reach (per-row
min lo / max hi) skips its compute. Float32 logits and accumulators; the
probabilities meet the values in the values' dtype, as in the flash kernels.
A query that sees no key gets out 0 and lse -inf.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ptx_kernels import blockwise
from ptx_kernels import implementation
from ptx_kernels import mask as mask_lib
from ptx_kernels import pallas_gpu
from ptx_kernels import pallas_tpu

# Query rows per GPU program at most: the f32 accumulator [bm, Dv] lives in
# registers, where all of a long prefill chunk's G * T rows would not fit.
_GPU_QUERY_TILE = 64
_NEVER = jnp.iinfo(jnp.int32).min  # both bounds of a padded query: no key position is at or below it


def check(kernel: implementation.Kernel, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> None:
  """Raises ValueError if `kernel` cannot run these heads and pages (only the GPU kernel has rules)."""
  kernel.check(q, v_pages)
  s = k_pages.shape[2]
  # A page is the key tile of both dots, whose tiles Triton wants as it wants head dims.
  if kernel.name == "pallas_gpu" and not pallas_gpu.takes_head_dim(s):
    raise ValueError(f"pallas_gpu needs a page size (slots) that is a power of two >= 16, got {s} "
                     f"(k_pages {tuple(k_pages.shape)})")


def _scores(q, k, start, lo, hi, qk, *, scale: float, softcap: float | None):
  """Scaled (soft-capped) f32 logits [M, S] of a page whose first position is `start`, -inf where unseen."""
  x = qk(q, k.astype(q.dtype)) * scale
  if softcap is not None:
    x = softcap * jnp.tanh(x / softcap)
  pos = start + lax.broadcasted_iota(jnp.int32, (1, k.shape[0]), 1)
  return jnp.where((pos > lo) & (pos <= hi), x, -jnp.inf)


def _fold(x, carry, v, pv):
  """One page's logits x [M, S] folded into the online softmax (acc [M, Dv], max [M, 1], sum [M, 1])."""
  acc, m, l = carry
  m_new = jnp.maximum(m, jnp.max(x, axis=1, keepdims=True))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  p = jnp.exp(x - m_safe)
  alpha = jnp.exp(m - m_safe)
  return alpha * acc + pv(p.astype(v.dtype), v), m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True)


def _finish(acc, m, l):
  """(out, lse) of an online softmax; 0 and -inf where nothing was seen."""
  safe = jnp.where(l > 0, l, 1.0)
  return acc / safe, jnp.where(l > 0, m + jnp.log(safe), -jnp.inf)


def _reaches(start, s, lo_min, hi_max):
  """Whether a page of s slots from `start` holds a key some query of its row may see."""
  return (start <= hi_max) & (start + s - 1 > lo_min)


def _tpu_kernel(rows_ref, pages_ref, index_ref, meta_ref, q_ref, lo_ref, hi_ref, k_ref, v_ref, o_ref, lse_ref,
                acc, m_scr, l_scr, **logits):
  """One (kv head, pair) step: the pair's page folded into its row's running softmax."""
  del pages_ref  # read by the index maps only
  i = pl.program_id(1)
  row = rows_ref[i]
  s = k_ref.shape[0]
  start = index_ref[i] * s

  @pl.when(i == meta_ref[4 * row])
  def _():
    acc[...] = jnp.zeros_like(acc)
    m_scr[...] = jnp.full_like(m_scr, -jnp.inf)
    l_scr[...] = jnp.zeros_like(l_scr)

  @pl.when(_reaches(start, s, meta_ref[4 * row + 2], meta_ref[4 * row + 3]))
  def _():
    x = _scores(q_ref[...], k_ref[...], start, lo_ref[...], hi_ref[...],
                lambda a, b: pallas_tpu._dot(a, b, 1, 1), **logits)
    acc[...], m_scr[...], l_scr[...] = _fold(x, (acc[...], m_scr[...], l_scr[...]), v_ref[...],
                                             lambda a, b: pallas_tpu._dot(a, b, 1, 0))

  @pl.when(i == meta_ref[4 * row + 1] - 1)
  def _():
    out, lse = _finish(acc[...], m_scr[...], l_scr[...])
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _tpu(q, lo, hi, k_pages, v_pages, rows, pages, index, meta, logits, interpret, out_type):
  """Launches the TPU kernel: (out [R, KV, M, Dv], lse [R, KV, M, 1])."""
  r, kvh, m, d = q.shape
  s, dv = k_pages.shape[2], v_pages.shape[-1]
  at_row = lambda w: pl.BlockSpec((None, None, m, w), lambda h, i, rows, *_: (rows[i], h, 0, 0))
  bounds = pl.BlockSpec((None, m, 1), lambda h, i, rows, *_: (rows[i], 0, 0))
  at_page = lambda w: pl.BlockSpec((None, None, s, w), lambda h, i, rows, pages, *_: (pages[i], h, 0, 0))
  out, lse = pl.pallas_call(
      functools.partial(_tpu_kernel, **logits),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=(kvh, rows.shape[0]),
          in_specs=[at_row(d), bounds, bounds, at_page(d), at_page(dv)],
          out_specs=[at_row(dv), at_row(1)],
          scratch_shapes=[pltpu.VMEM((m, dv), jnp.float32), pltpu.VMEM((m, 1), jnp.float32),
                          pltpu.VMEM((m, 1), jnp.float32)]),
      out_shape=[out_type((r, kvh, m, dv)), out_type((r, kvh, m, 1), jnp.float32)],
      # Pairs revisit their row's output block, so they run in order.
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False, name="ptx_paged_tpu",
  )(rows, pages, index, meta.reshape(-1), q, lo, hi, k_pages, v_pages)
  # No step writes the blocks of a row without pairs.
  held = jnp.zeros(r, bool).at[rows].set(True)[:, None, None, None]
  return jnp.where(held, out, 0), jnp.where(held, lse, -jnp.inf)


def _gpu_kernel(meta_ref, pages_ref, index_ref, q_ref, lo_ref, hi_ref, k_ref, v_ref, o_ref, lse_ref, **logits):
  """One (row, kv head, query tile) program: the row's pairs, one page at a time."""
  q, lo, hi = q_ref[...], lo_ref[...], hi_ref[...]
  s = k_ref.shape[1]
  lo_min, hi_max = meta_ref[2], meta_ref[3]

  def body(j, carry):
    page, start = pages_ref[j], index_ref[j] * s

    def compute(carry):
      x = _scores(q, k_ref[page], start, lo, hi, lambda a, b: pallas_gpu._mm(a, b, trans_b=True), **logits)
      return _fold(x, carry, v_ref[page], pallas_gpu._mm)

    return lax.cond(_reaches(start, s, lo_min, hi_max), compute, lambda c: c, carry)

  bm = q.shape[0]
  init = (jnp.zeros((bm, v_ref.shape[-1]), jnp.float32), jnp.full((bm, 1), -jnp.inf, jnp.float32),
          jnp.zeros((bm, 1), jnp.float32))
  out, lse = _finish(*lax.fori_loop(meta_ref[0], meta_ref[1], body, init))
  o_ref[...] = out.astype(o_ref.dtype)
  lse_ref[...] = lse


def _gpu(q, lo, hi, k_pages, v_pages, rows, pages, index, meta, logits, interpret, out_type):
  """Launches the GPU kernel: (out [R, KV, M, Dv], lse [R, KV, M, 1])."""
  r, kvh, m, d = q.shape
  p, _, s, dv = v_pages.shape
  n, bm = rows.shape[0], min(m, _GPU_QUERY_TILE)
  tile = lambda w: pl.BlockSpec((None, None, bm, w), lambda r, h, j: (r, h, j, 0))
  bounds = pl.BlockSpec((None, bm, 1), lambda r, h, j: (r, j, 0))
  pool = lambda w: pl.BlockSpec((p, None, s, w), lambda r, h, j: (0, h, 0, 0))
  pairs = pl.BlockSpec((n,), lambda r, h, j: (0,))
  return pl.pallas_call(
      functools.partial(_gpu_kernel, **logits),
      grid=(r, kvh, m // bm),
      in_specs=[pl.BlockSpec((None, 4), lambda r, h, j: (r, 0)), pairs, pairs, tile(d), bounds, bounds, pool(d),
                pool(dv)],
      out_specs=[tile(dv), tile(1)],
      out_shape=[out_type((r, kvh, m, dv)), out_type((r, kvh, m, 1), jnp.float32)],
      compiler_params=pallas_gpu._params(d), interpret=interpret, name="ptx_paged_gpu",
  )(meta, pages, index, q, lo, hi, k_pages, v_pages)


def attention(q, k_pages, v_pages, rows, pages, index, lengths, q_positions, *, causal: bool, window, softcap,
              scale: float, kernel: implementation.Kernel):
  """`paged.paged_attention` (checked inputs) by the Pallas `kernel`: (out [R, T, H, Dv] in q.dtype, lse [R, H, T])."""
  r, t, h, d = q.shape
  kvh = k_pages.shape[1]
  g = h // kvh
  m = max(16, 1 << (g * t - 1).bit_length())
  # key_bounds reads the positions and the window only; the length caps each interval.
  lo, hi = mask_lib.key_bounds(mask_lib.MaskInputs(None, None, q_positions, None, window), causal)
  hi = jnp.minimum(hi, lengths[:, None] - 1)
  rows, pages, index = (jnp.asarray(x, jnp.int32) for x in (rows, pages, index))
  ids = jnp.arange(r, dtype=jnp.int32)
  # Per row: its pairs [start, end) and the least lo and most hi of its queries.
  meta = jnp.stack([jnp.searchsorted(rows, ids, side="left"), jnp.searchsorted(rows, ids, side="right"),
                    jnp.min(lo, axis=1), jnp.max(hi, axis=1)], axis=1).astype(jnp.int32)
  flat = lambda x: jnp.pad(jnp.tile(x, (1, g)), ((0, 0), (0, m - g * t)), constant_values=_NEVER)[..., None]
  q_RKMD = q.reshape(r, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(r, kvh, g * t, d)
  q_RKMD = jnp.pad(q_RKMD.astype(jnp.promote_types(q.dtype, k_pages.dtype)), ((0, 0), (0, 0), (0, m - g * t), (0, 0)))
  logits = dict(scale=float(scale), softcap=None if softcap is None else float(softcap))
  out_type = lambda shape, dtype=q.dtype: blockwise.varying_struct(shape, dtype, q, k_pages, v_pages, rows, lengths)
  launch = _tpu if kernel.name == "pallas_tpu" else _gpu
  out, lse = launch(q_RKMD, flat(lo), flat(hi), k_pages, v_pages, rows, pages, index, meta, logits, kernel.interpret,
                    out_type)
  out = out[:, :, :g * t].reshape(r, kvh, g, t, -1).transpose(0, 3, 1, 2, 4).reshape(r, t, h, -1)
  return out, lse[:, :, :g * t, 0].reshape(r, h, t)
