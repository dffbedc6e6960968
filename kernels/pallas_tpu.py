"""Flash attention for TPUs as Mosaic Pallas kernels, forward and backward.

Grids put the reduction last, marked "arbitrary", and accumulate in VMEM
scratch, written out on the reduction's final step:
  forward  (B, H, T/bq, S/bk): out, natural-log LSE;
  dq       (B, H, T/bq, S/bk): dQ;
  dk/dv    (B, KV, S/bk, G*T/bq): dK, dV summed over the G query heads of
           each kv head, so GQA gradients need no extra reduction.
Per-tile bounds (`mask.tile_summaries`) are prefetched into SMEM; tile pairs
that cannot see each other skip their compute. Arrays are moved to the
head-major layout [B, H, T, D] the TPU tiles want; per-query mask data travel
as [B, T, 3] (segment, lo, hi) and per-key data as [B, 2, S] (segment, pos).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ptx_kernels import blockwise
from ptx_kernels import mask as mask_lib


def _may_see(qsum_ref, kvsum_ref, b, i, j, nq, nk):
  """Reads two tile summaries from SMEM and tests them."""
  row = lambda ref, n, t: [ref[(b * n + t) * 4 + c] for c in range(4)]
  return mask_lib.tiles_may_see(row(qsum_ref, nq, i), row(kvsum_ref, nk, j))


def _tile_logits(qids, kvids, q, k, st: blockwise.Static):
  """Mask [bq, bk], scaled (soft-capped) f32 logits and d(cap)/d(x)."""
  ok = ((qids[:, 0:1] == kvids[0:1, :]) & (qids[:, 0:1] != 0)
        & (kvids[1:2, :] > qids[:, 1:2]) & (kvids[1:2, :] <= qids[:, 2:3]))
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                      preferred_element_type=jnp.float32) * st.scale
  if st.softcap is None:
    return ok, s, None
  t = jnp.tanh(s / st.softcap)
  return ok, st.softcap * t, 1.0 - t * t


def _dot(a, b, contract_a: int, contract_b: int):
  """f32-accumulated matmul contracting one axis of each operand."""
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _fwd_kernel(qsum_ref, kvsum_ref, qids_ref, kvids_ref, q_ref, k_ref, v_ref,
                o_ref, lse_ref, acc, m_scr, l_scr, *, st, nq, nk):
  """Online-softmax step of one (query tile, key tile) pair."""
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    acc[...] = jnp.zeros_like(acc)
    m_scr[...] = jnp.full_like(m_scr, -jnp.inf)
    l_scr[...] = jnp.zeros_like(l_scr)

  @pl.when(_may_see(qsum_ref, kvsum_ref, b, i, j, nq, nk))
  def _():
    ok, s, _ = _tile_logits(qids_ref[...], kvids_ref[...], q_ref[...],
                            k_ref[...], st)
    s = jnp.where(ok, s, -jnp.inf)
    m_prev = m_scr[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
    acc[...] = alpha * acc[...] + _dot(p.astype(v_ref.dtype), v_ref[...], 1, 0)
    m_scr[...] = m_new

  @pl.when(j == nk - 1)
  def _():
    l = l_scr[...]
    safe = jnp.where(l > 0, l, 1.0)
    o_ref[...] = (acc[...] / safe).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(l > 0, m_scr[...] + jnp.log(safe), -jnp.inf)


def _grad_tile(qids, kvids, q, k, v, do, lse, delta, st):
  """P and dS (scaled, in q.dtype) of one tile pair."""
  ok, s, dcap = _tile_logits(qids, kvids, q, k, st)
  p = jnp.exp(jnp.where(ok, s - lse, -jnp.inf))
  ds = p * (_dot(do, v, 1, 1) - delta)
  if dcap is not None:
    ds *= dcap
  return p, (ds * st.scale).astype(q.dtype)


def _dq_kernel(qsum_ref, kvsum_ref, qids_ref, kvids_ref, q_ref, k_ref, v_ref,
               do_ref, lse_ref, delta_ref, dq_ref, acc, *, st, nq, nk):
  """dQ contribution of one (query tile, key tile) pair."""
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    acc[...] = jnp.zeros_like(acc)

  @pl.when(_may_see(qsum_ref, kvsum_ref, b, i, j, nq, nk))
  def _():
    k = k_ref[...]
    _, ds = _grad_tile(qids_ref[...], kvids_ref[...], q_ref[...], k,
                       v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], st)
    acc[...] += _dot(ds, k, 1, 0)

  @pl.when(j == nk - 1)
  def _():
    dq_ref[...] = acc[...].astype(dq_ref.dtype)


def _dkv_kernel(qsum_ref, kvsum_ref, qids_ref, kvids_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc, *,
                st, nq, nk, g):
  """dK/dV contribution of one (key tile, query tile of one head) pair."""
  b, j, r = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(r == 0)
  def _():
    dk_acc[...] = jnp.zeros_like(dk_acc)
    dv_acc[...] = jnp.zeros_like(dv_acc)

  @pl.when(_may_see(qsum_ref, kvsum_ref, b, r % nq, j, nq, nk))
  def _():
    q, do = q_ref[...], do_ref[...]
    p, ds = _grad_tile(qids_ref[...], kvids_ref[...], q, k_ref[...],
                       v_ref[...], do, lse_ref[...], delta_ref[...], st)
    dv_acc[...] += _dot(p.astype(do.dtype), do, 0, 0)
    dk_acc[...] += _dot(ds, q, 0, 0)

  @pl.when(r == g * nq - 1)
  def _():
    dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _layout(q, k, v, mi, st):
  """Head-major arrays, mask tiles and SMEM tile bounds for the kernels."""
  lo, hi = mask_lib.key_bounds(mi, st.causal)
  qsum, kvsum = mask_lib.tile_summaries(mi, lo, hi, st.block_q, st.block_kv)
  qids = jnp.stack([mi.q_segment_ids, lo, hi], axis=-1)
  kvids = jnp.stack([mi.kv_segment_ids, mi.kv_positions], axis=1)
  heads = lambda x: jnp.swapaxes(x, 1, 2)
  return (qsum.reshape(-1), kvsum.reshape(-1), qids, kvids, heads(q),
          heads(k), heads(v))


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, interpret,
          name):
  """A pallas_call with two SMEM-prefetched tile summaries, last axis reducing."""
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=grid, in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False, name=name)


def forward(q, k, v, mi, st, interpret, out_dtype=None):
  """Launches the forward kernel on tile-multiple inputs; out in `out_dtype` (default q's)."""
  out_type = lambda shape, dtype: blockwise.varying_struct(shape, dtype, q, k,
                                                           v, mi)
  b, t, h, d = q.shape
  s, kvh, dv = k.shape[1], k.shape[2], v.shape[-1]
  g, nq, nk = h // kvh, t // st.block_q, s // st.block_kv
  bq, bk = st.block_q, st.block_kv
  q_at = lambda w: pl.BlockSpec((None, None, bq, w), lambda b, h, i, j, *_: (b, h, i, 0))
  kv_at = lambda w: pl.BlockSpec((None, None, bk, w),
                                 lambda b, h, i, j, *_: (b, h // g, j, 0))
  out, lse = _call(
      functools.partial(_fwd_kernel, st=st, nq=nq, nk=nk), (b, h, nq, nk),
      [pl.BlockSpec((None, bq, 3), lambda b, h, i, j, *_: (b, i, 0)),
       pl.BlockSpec((None, 2, bk), lambda b, h, i, j, *_: (b, 0, j)),
       q_at(d), kv_at(d), kv_at(dv)],
      [q_at(dv), q_at(1)],
      [out_type((b, h, t, dv), out_dtype or q.dtype), out_type((b, h, t, 1), jnp.float32)],
      [pltpu.VMEM((bq, dv), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
       pltpu.VMEM((bq, 1), jnp.float32)],
      interpret, "ptx_flash_fwd_tpu",
  )(*_layout(q, k, v, mi, st))
  return jnp.swapaxes(out, 1, 2), lse[..., 0]


def backward(q, k, v, mi, st, lse, delta, dout, interpret, grad_dtype=None):
  """Launches the dQ and dK/dV kernels on tile-multiple inputs (arguments as `pallas_gpu.backward`'s)."""
  grad_type = blockwise.grad_structs(grad_dtype, q, k, v, mi, lse, delta, dout)
  b, t, h, d = q.shape
  s, kvh, dv = k.shape[1], k.shape[2], v.shape[-1]
  g, nq, nk = h // kvh, t // st.block_q, s // st.block_kv
  bq, bk = st.block_q, st.block_kv
  args = _layout(q, k, v, mi, st) + (
      jnp.swapaxes(dout, 1, 2), lse[..., None], delta[..., None])
  # dQ: grid (b, h, i, j).
  q_at = lambda w: pl.BlockSpec((None, None, bq, w), lambda b, h, i, j, *_: (b, h, i, 0))
  kv_at = lambda w: pl.BlockSpec((None, None, bk, w),
                                 lambda b, h, i, j, *_: (b, h // g, j, 0))
  dq = _call(
      functools.partial(_dq_kernel, st=st, nq=nq, nk=nk), (b, h, nq, nk),
      [pl.BlockSpec((None, bq, 3), lambda b, h, i, j, *_: (b, i, 0)),
       pl.BlockSpec((None, 2, bk), lambda b, h, i, j, *_: (b, 0, j)),
       q_at(d), kv_at(d), kv_at(dv), q_at(dv), q_at(1), q_at(1)],
      q_at(d), grad_type((b, h, t, d), q),
      [pltpu.VMEM((bq, d), jnp.float32)], interpret, "ptx_flash_dq_tpu",
  )(*args)
  # dK/dV: grid (b, kv head, j, r) with r walking query tiles of each of the G
  # heads in turn.
  q_of = lambda w: pl.BlockSpec(
      (None, None, bq, w), lambda b, kh, j, r, *_: (b, kh * g + r // nq, r % nq, 0))
  kv_of = lambda w: pl.BlockSpec((None, None, bk, w),
                                 lambda b, kh, j, r, *_: (b, kh, j, 0))
  dk, dv_ = _call(
      functools.partial(_dkv_kernel, st=st, nq=nq, nk=nk, g=g),
      (b, kvh, nk, g * nq),
      [pl.BlockSpec((None, bq, 3), lambda b, kh, j, r, *_: (b, r % nq, 0)),
       pl.BlockSpec((None, 2, bk), lambda b, kh, j, r, *_: (b, 0, j)),
       q_of(d), kv_of(d), kv_of(dv), q_of(dv), q_of(1), q_of(1)],
      [kv_of(d), kv_of(dv)],
      [grad_type((b, kvh, s, d), k), grad_type((b, kvh, s, dv), v)],
      [pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, dv), jnp.float32)],
      interpret, "ptx_flash_dkv_tpu",
  )(*args)
  tokens_major = lambda x: jnp.swapaxes(x, 1, 2)
  return tokens_major(dq), tokens_major(dk), tokens_major(dv_)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def attention(q, k, v, mi: mask_lib.MaskInputs, st: blockwise.Static,
              interpret: bool):
  """TPU flash attention (lengths must be tile multiples): (out, lse)."""
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
