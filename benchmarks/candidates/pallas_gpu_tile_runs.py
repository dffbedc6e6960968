"""CANDIDATE, not part of ptx: the Pallas GPU flash kernel as commit 15da255 rewrote it ("tile runs"), which 188eb02
reverted. The device check's `tile_runs` section runs it in place of `ptx_kernels.pallas_gpu`
(`attention_gpu.gpu_kernel`) to check it and time it against the current kernel.

Why it is here: on the H200 (12-04, benchmarks/RESULTS.md "The second run") it ran causal bfloat16 attention 1.7-2.4x
faster than the kernel in ptx_kernels (118 / 218 / 225 TFLOP/s forward at 4K / 16K / 64K against 71 / 94 / 93), but
its float32 check did not finish within that section's 89 s and it was never checked on a GPU, so it was reverted.
The third run then showed that the float32 "hang" was Triton compiling 128 x 64 float32 tiles (about 85 s for the
kernel in ptx too); float32 now defaults to 64 x 32. The device machine gets the working tree without .git, so the
check cannot `git revert 188eb02` there: this copy travels with the tree instead.

When to delete or promote it: once a device check's `tile_runs` section has run. If every case passes in both dtypes
and it is faster, promote it: `git revert 188eb02` (which brings back this kernel and its test of the tile runs,
tests/benchmarks/test_pallas_gpu_tile_runs.py here) and delete this file, its test and the section. If a case fails,
delete them all and record why in RESULTS. Either way no copy stays beside ptx_kernels.pallas_gpu.

It is 15da255's kernels/pallas_gpu.py unchanged below this header (its imports of ptx_kernels' blockwise and mask
modules still resolve); its original docstring follows.

Flash attention for GPUs as Triton-style Pallas kernels, forward and backward.

Three kernels, each a grid of independent tiles:
  forward  grid (B, H, T/bq): one query tile against all key tiles, online
           softmax, writes out and the natural-log LSE;
  dq       grid (B, H, T/bq): recomputes P = exp(S - lse), accumulates dQ;
  dk/dv    grid (B, KV, S/bk): one key tile against every query tile of the
           G query heads that share it, so GQA gradients need no reduction.
Each tile loops over the run of opposite tiles it may see: XLA computes,
from per-tile summaries of segments and positions (`mask.tile_summaries`),
the first and last such tile, and the loop runs between them with no branch
inside, so Triton pipelines its loads (a `lax.cond` around each step, as
this kernel had before, keeps it from prefetching the next tile: 70-97
TFLOP/s causal on an H200 against cuDNN's 157-635). Causal attention loops
over the triangle; tiles inside the run that packing hides are computed and
masked. Masks arrive as per-query visible key-position intervals
(`mask.key_bounds`). The logits use the natural exponent, so the LSE needs
no base-2 correction.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ptx_kernels import blockwise
from ptx_kernels import mask as mask_lib


def takes_head_dim(n: int) -> bool:
  """Whether the kernel runs heads of width n: Triton's dots take power-of-two tiles of at least 16 per axis."""
  return n >= 16 and not n & (n - 1)


def check_head_dims(q_shape, v_shape) -> None:
  """Raises ValueError unless both head dims are powers of two >= 16."""
  for name, shape in (("head_dim", q_shape), ("value head_dim", v_shape)):
    n = shape[-1]
    if not takes_head_dim(n):
      raise ValueError(f"pallas_gpu needs {name} a power of two >= 16, got {n} "
                       f"(q {tuple(q_shape)}, v {tuple(v_shape)})")


def _mm(a, b, trans_a: bool = False, trans_b: bool = False):
  """f32-accumulated matmul; float32 inputs stay IEEE (Triton would use tf32)."""
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b,
                   allow_tf32=False if a.dtype == jnp.float32 else None)


def _logits(q, k, st: blockwise.Static):
  """Scaled, soft-capped f32 logits [bq, bk] and d(cap)/d(x) (or None)."""
  s = _mm(q, k, trans_b=True) * st.scale
  if st.softcap is None:
    return s, None
  t = jnp.tanh(s / st.softcap)
  return st.softcap * t, 1.0 - t * t


def _visible(qseg, lo, hi, kseg, kpos):
  """Boolean [bq, bk]: same non-zero segment, key position in (lo, hi]."""
  return ((qseg[:, None] == kseg[None, :]) & (qseg[:, None] != 0)
          & (kpos[None, :] <= hi[:, None]) & (kpos[None, :] > lo[:, None]))


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, lo_ref, hi_ref, kseg_ref,
                kpos_ref, first_ref, stop_ref, o_ref, lse_ref, *, st: blockwise.Static):
  """One query tile over the key tiles it may see: out and natural-log LSE."""
  q, qseg, lo, hi = q_ref[...], qseg_ref[...], lo_ref[...], hi_ref[...]
  bq, bk = q.shape[0], st.block_kv

  def body(j, carry):
    o, m, l = carry
    sl = pl.ds(j * bk, bk)
    ok = _visible(qseg, lo, hi, kseg_ref[sl], kpos_ref[sl])
    s, _ = _logits(q, k_ref[sl, :], st)
    s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[:, None])
    alpha = jnp.exp(m - m_safe)
    pv = _mm(p.astype(v_ref.dtype), v_ref[sl, :])
    return alpha[:, None] * o + pv, m_new, alpha * l + jnp.sum(p, axis=1)

  init = (jnp.zeros((bq, v_ref.shape[-1]), jnp.float32),
          jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
  o, m, l = lax.fori_loop(first_ref[0], stop_ref[0], body, init)
  safe = jnp.where(l > 0, l, 1.0)
  o_ref[...] = (o / safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(l > 0, m + jnp.log(safe), -jnp.inf)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref,
               lo_ref, hi_ref, kseg_ref, kpos_ref, first_ref, stop_ref, dq_ref, *,
               st: blockwise.Static):
  """One query tile over the key tiles it may see: dQ."""
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  qseg, lo, hi = qseg_ref[...], lo_ref[...], hi_ref[...]
  bk = st.block_kv

  def body(j, dq):
    sl = pl.ds(j * bk, bk)
    ok = _visible(qseg, lo, hi, kseg_ref[sl], kpos_ref[sl])
    k = k_ref[sl, :]
    s, dcap = _logits(q, k, st)
    p = jnp.exp(jnp.where(ok, s - lse[:, None], -jnp.inf))
    ds = p * (_mm(do, v_ref[sl, :], trans_b=True) - delta[:, None])
    if dcap is not None:
      ds *= dcap
    return dq + _mm((ds * st.scale).astype(k.dtype), k)

  dq = lax.fori_loop(first_ref[0], stop_ref[0], body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref,
                lo_ref, hi_ref, kseg_ref, kpos_ref, first_ref, stop_ref, dk_ref, dv_ref, *,
                st: blockwise.Static):
  """One key tile over the query tiles of its G heads that may see it: dK, dV."""
  k, v, kseg, kpos = k_ref[...], v_ref[...], kseg_ref[...], kpos_ref[...]
  bq = st.block_q

  def body(i, carry, g):
    dk, dv = carry
    sl = pl.ds(i * bq, bq)
    ok = _visible(qseg_ref[sl], lo_ref[sl], hi_ref[sl], kseg, kpos)
    q, do = q_ref[sl, g, :], do_ref[sl, g, :]
    s, dcap = _logits(q, k, st)
    p = jnp.exp(jnp.where(ok, s - lse_ref[g, sl][:, None], -jnp.inf))
    dv += _mm(p.astype(do.dtype), do, trans_a=True)
    ds = p * (_mm(do, v, trans_b=True) - delta_ref[g, sl][:, None])
    if dcap is not None:
      ds *= dcap
    dk += _mm((ds * st.scale).astype(q.dtype), q, trans_a=True)
    return dk, dv

  carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  for g in range(q_ref.shape[1]):  # The G query heads sharing this kv head.
    carry = lax.fori_loop(first_ref[0], stop_ref[0], functools.partial(body, g=g), carry)
  dk_ref[...] = carry[0].astype(dk_ref.dtype)
  dv_ref[...] = carry[1].astype(dv_ref.dtype)


def _params(d: int):
  """Triton launch parameters for a head dim."""
  return plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2)


def _runs(mi, lo, hi, st) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The run of tiles each tile may see: (first, stop) key tiles per query tile [B, T/bq] and query tiles per key tile
  [B, S/bk], int32; stop <= first where it sees none (`mask.tiles_may_see`, so a tile outside a run is all masked).
  """
  q_sum, kv_sum = mask_lib.tile_summaries(mi, lo, hi, st.block_q, st.block_kv)
  may = mask_lib.tiles_may_see(jnp.moveaxis(q_sum, -1, 0)[:, :, :, None],
                               jnp.moveaxis(kv_sum, -1, 0)[:, :, None, :])  # [B, T/bq, S/bk]

  def run(may):  # first and one past the last True along the last axis; (0, 0) where none
    n = may.shape[-1]
    first = jnp.argmax(may, axis=-1)
    stop = n - jnp.argmax(may[..., ::-1], axis=-1)
    seen = jnp.any(may, axis=-1)
    return jnp.where(seen, first, 0).astype(jnp.int32), jnp.where(seen, stop, 0).astype(jnp.int32)

  return (*run(may), *run(jnp.swapaxes(may, 1, 2)))


def forward(q, k, v, mi, st, interpret, out_dtype=None):
  """Launches the forward kernel on tile-multiple inputs; out in `out_dtype` (default q's)."""
  out_type = lambda shape, dtype: blockwise.varying_struct(shape, dtype, q, k,
                                                           v, mi)
  b, t, h, d = q.shape
  s, kvh, dv = k.shape[1], k.shape[2], v.shape[-1]
  g = h // kvh
  lo, hi = mask_lib.key_bounds(mi, st.causal)
  first, stop, _, _ = _runs(mi, lo, hi, st)
  q_tile = pl.BlockSpec((None, st.block_q, None, d), lambda b, h, i: (b, i, h, 0))
  kv_full = lambda width: pl.BlockSpec(
      (None, s, None, width), lambda b, h, i: (b, 0, h // g, 0))
  q_ids = pl.BlockSpec((None, st.block_q), lambda b, h, i: (b, i))
  kv_ids = pl.BlockSpec((None, s), lambda b, h, i: (b, 0))
  tile_run = pl.BlockSpec((None, 1), lambda b, h, i: (b, i))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, st=st),
      grid=(b, h, t // st.block_q),
      in_specs=[q_tile, kv_full(d), kv_full(dv), q_ids, q_ids, q_ids, kv_ids,
                kv_ids, tile_run, tile_run],
      out_specs=[
          pl.BlockSpec((None, st.block_q, None, dv), lambda b, h, i: (b, i, h, 0)),
          pl.BlockSpec((None, None, st.block_q), lambda b, h, i: (b, h, i))],
      out_shape=[out_type((b, t, h, dv), out_dtype or q.dtype),
                 out_type((b, h, t), jnp.float32)],
      compiler_params=_params(d), interpret=interpret, name="ptx_flash_fwd",
  )(q, k, v, mi.q_segment_ids, lo, hi, mi.kv_segment_ids, mi.kv_positions, first, stop)


def backward(q, k, v, mi, st, lse, delta, dout, interpret, grad_dtype=None):
  """Launches the dQ and dK/dV kernels on tile-multiple inputs.

  `lse` and `delta` describe the attention over all keys, so k/v may be a
  part of them (a ring hop); the gradients come in `grad_dtype`, default the
  inputs' dtypes.
  """
  grad_type = blockwise.grad_structs(grad_dtype, q, k, v, mi, lse, delta, dout)
  b, t, h, d = q.shape
  s, kvh, dv = k.shape[1], k.shape[2], v.shape[-1]
  g = h // kvh
  lo, hi = mask_lib.key_bounds(mi, st.causal)
  ids = (mi.q_segment_ids, lo, hi, mi.kv_segment_ids, mi.kv_positions)
  q_first, q_stop, kv_first, kv_stop = _runs(mi, lo, hi, st)
  # dQ: query tiles over all keys of their kv head.
  q_tile = lambda w: pl.BlockSpec((None, st.block_q, None, w),
                                  lambda b, h, i: (b, i, h, 0))
  kv_full = lambda w: pl.BlockSpec((None, s, None, w),
                                   lambda b, h, i: (b, 0, h // g, 0))
  row_tile = pl.BlockSpec((None, None, st.block_q), lambda b, h, i: (b, h, i))
  q_ids = pl.BlockSpec((None, st.block_q), lambda b, h, i: (b, i))
  kv_ids = pl.BlockSpec((None, s), lambda b, h, i: (b, 0))
  tile_run = pl.BlockSpec((None, 1), lambda b, h, i: (b, i))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, st=st),
      grid=(b, h, t // st.block_q),
      in_specs=[q_tile(d), kv_full(d), kv_full(dv), q_tile(dv), row_tile,
                row_tile, q_ids, q_ids, q_ids, kv_ids, kv_ids, tile_run, tile_run],
      out_specs=q_tile(d),
      out_shape=grad_type(q.shape, q),
      compiler_params=_params(d), interpret=interpret, name="ptx_flash_dq",
  )(q, k, v, dout, lse, delta, *ids, q_first, q_stop)
  # dK/dV: key tiles over all queries of the G heads that read them.
  group = lambda w: pl.BlockSpec((None, t, g, w), lambda b, kh, j: (b, 0, kh, 0))
  kv_tile = lambda w: pl.BlockSpec((None, st.block_kv, None, w),
                                   lambda b, kh, j: (b, j, kh, 0))
  group_rows = pl.BlockSpec((None, g, t), lambda b, kh, j: (b, kh, 0))
  q_full = pl.BlockSpec((None, t), lambda b, kh, j: (b, 0))
  kv_ids = pl.BlockSpec((None, st.block_kv), lambda b, kh, j: (b, j))
  tile_run = pl.BlockSpec((None, 1), lambda b, kh, j: (b, j))
  dk, dv_ = pl.pallas_call(
      functools.partial(_dkv_kernel, st=st),
      grid=(b, kvh, s // st.block_kv),
      in_specs=[group(d), kv_tile(d), kv_tile(dv), group(dv), group_rows,
                group_rows, q_full, q_full, q_full, kv_ids, kv_ids, tile_run, tile_run],
      out_specs=[kv_tile(d), kv_tile(dv)],
      out_shape=[grad_type(k.shape, k),
                 grad_type(v.shape, v)],
      compiler_params=_params(d), interpret=interpret, name="ptx_flash_dkv",
  )(q, k, v, dout, lse, delta, *ids, kv_first, kv_stop)
  return dq, dk, dv_


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def attention(q, k, v, mi: mask_lib.MaskInputs, st: blockwise.Static,
              interpret: bool):
  """GPU flash attention (lengths must be tile multiples): (out, lse)."""
  return forward(q, k, v, mi, st, interpret)


def _attention_fwd(q, k, v, mi, st, interpret):
  """Forward rule: keeps only q, k, v, the mask inputs, out and lse."""
  out, lse = forward(q, k, v, mi, st, interpret)
  return (out, lse), (q, k, v, mi, out, lse)


def _attention_bwd(st, interpret, res, cts):
  """Backward rule: delta in XLA, then the two gradient kernels."""
  q, k, v, mi, out, lse = res
  dout, dlse = cts
  delta = blockwise.delta_of(out, dout, dlse)
  dq, dk, dv = backward(q, k, v, mi, st, lse, delta, dout.astype(q.dtype),
                         interpret)
  return dq, dk, dv, blockwise.no_cotangent(mi)


attention.defvjp(_attention_fwd, _attention_bwd)
