"""Blockwise flash attention in pure JAX with an O(T)-memory custom VJP.

The forward loops over query tiles, and inside each over key/value tiles with an
online softmax; the backward loops over key/value tiles, and inside each over
query tiles, recomputing P = exp(S - lse). The only residuals are q, k, v, out
and the natural-log LSE, so memory is linear in sequence length (plain autodiff
through the loops would keep every tile's P: quadratic). Tiles whose mask is all
False are skipped with `lax.cond`: about half the tiles of a causal mask.

Internal layout: q [B, T, KV, G, D] (a free reshape of [B, T, H, D] with head
h = kv * G + g), so grouped-query attention never repeats K or V.
`forward` and `backward` accept accumulators so the ring can fold every ring
step into one set of buffers instead of materialising per-step copies.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from ptx_kernels import lse as lse_lib
from ptx_kernels import mask as mask_lib
from ptx_kernels import xla_cpu_workarounds


@dataclasses.dataclass(frozen=True)
class Static:
  """Compile-time settings of one attention call."""

  causal: bool
  softcap: float | None
  scale: float
  block_q: int
  block_kv: int


def _logits(q_i, k_j, st: Static):
  """Scaled (and soft-capped) f32 logits [B, KV, G, bq, bk] and d(cap)/d(x)."""
  s = jnp.einsum("bqkgd,bskd->bkgqs", q_i, k_j,
                 preferred_element_type=jnp.float32) * st.scale
  if st.softcap is None:
    return s, None
  t = jnp.tanh(s / st.softcap)
  return st.softcap * t, 1.0 - t * t


def _varying_axes(refs) -> frozenset:
  """The manual mesh axes that any leaf of refs varies over (inside shard_map)."""
  return frozenset().union(*(jax.typeof(r).manual_axis_type.varying
                             for r in jax.tree.leaves(refs)))


def vary_like(tree, *refs):
  """Marks fresh arrays as varying over every manual axis that refs vary over.

  Inside `shard_map` loop carries and `cond` branches must agree on which mesh
  axes a value varies over; zeros built here vary over none until told.
  """
  axes = _varying_axes(refs)

  def cast(x):
    missing = tuple(sorted(axes - set(jax.typeof(x).manual_axis_type.varying)))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def varying_struct(shape, dtype, *refs) -> jax.ShapeDtypeStruct:
  """The type of a kernel output that varies over every manual axis refs vary over.

  Inside `shard_map` a `pallas_call` cannot infer that from its inputs.
  """
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=(
      jax.sharding.ManualAxisType(varying=_varying_axes(refs))))


def grad_structs(grad_dtype, *refs):
  """`(shape, like) -> varying_struct`: a Pallas backward's gradient type, `like`'s dtype unless `grad_dtype`."""
  return lambda shape, like: varying_struct(
      shape, like.dtype if grad_dtype is None else grad_dtype, *refs)


def loop(n, body, carry, operands):
  """`fori_loop(0, n)` of `body(i, carry, operands)` over read-only operands.

  The operands ride in the carry, unchanged (no copy: the loop aliases
  them). On XLA:CPU an optimization barrier there keeps its upcast of bf16
  tiles inside the loop, on one tile (`xla_cpu_workarounds`).
  """
  barrier = xla_cpu_workarounds.active()

  def step(i, state):
    carry, operands = state
    if barrier:
      operands = lax.optimization_barrier(operands)
    return body(i, carry, operands), operands

  return lax.fori_loop(0, n, step, (carry, operands))[0]


# XLA:CPU updates a bf16 array in float32, a full-size copy per update;
# writing the raw 16 bits is in place (`xla_cpu_workarounds`).
_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16): jnp.uint16}


def update_along(x, tile, start, axis: int):
  """x with `tile` (cast to x.dtype) written at `start` along `axis`."""
  tile = tile.astype(x.dtype)
  bits = _BITS.get(x.dtype)
  if bits is None or not xla_cpu_workarounds.active():
    return lax.dynamic_update_slice_in_dim(x, tile, start, axis)
  raw = lax.dynamic_update_slice_in_dim(
      lax.bitcast_convert_type(x, bits), lax.bitcast_convert_type(tile, bits),
      start, axis)
  return lax.bitcast_convert_type(raw, x.dtype)


def _tie(q, k, v, mi: mask_lib.MaskInputs):
  """Makes the mask inputs depend on q, k and v (an optimization barrier).

  Inside a differentiated scan (the model's layers), JAX hoists computations
  that depend only on loop constants out of the loop and stacks their
  per-iteration values: the tile masks, built from positions and segment
  ids alone, would become an O(T^2) array.
  """
  return lax.optimization_barrier((q, k, v, mi))


def _tile(x, start, size: int):
  """Rows [start, start + size) of x along the sequence axis (axis 1)."""
  return lax.dynamic_slice_in_dim(x, start, size, 1)


def _tile_mask(mi: mask_lib.MaskInputs, i, j, st: Static):
  """Visibility [B, 1, 1, bq, bk] of kv tile j for query tile i."""
  qsl = lambda x: _tile(x, i * st.block_q, st.block_q)
  ksl = lambda x: _tile(x, j * st.block_kv, st.block_kv)
  ok = mask_lib.visible(
      qsl(mi.q_segment_ids), ksl(mi.kv_segment_ids), qsl(mi.q_positions),
      ksl(mi.kv_positions), causal=st.causal, window=mi.window)
  return ok[:, None, None]


def _attend_tile(q_i, k, v, mi, i, st: Static):
  """Attention of query tile i over all keys: (out [B,bq,H,Dv] f32, lse [B,H,bq])."""
  b, bq, kvh, g, _ = q_i.shape
  dv = v.shape[-1]

  def step(j, carry, kv):
    k, v = kv
    ok = _tile_mask(mi, i, j, st)

    def compute(carry):
      o, m, l = carry
      k_j = _tile(k, j * st.block_kv, st.block_kv)
      v_j = _tile(v, j * st.block_kv, st.block_kv)
      s, _ = _logits(q_i, k_j, st)
      s = jnp.where(ok, s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v_j,
                      preferred_element_type=jnp.float32)
      return alpha[..., None] * o + pv, m_new, alpha * l + jnp.sum(p, axis=-1)

    return lax.cond(jnp.any(ok), compute, lambda c: c, carry)

  init = vary_like((jnp.zeros((b, kvh, g, bq, dv), jnp.float32),
                    jnp.full((b, kvh, g, bq), -jnp.inf, jnp.float32),
                    jnp.zeros((b, kvh, g, bq), jnp.float32)), q_i, k, v, mi)
  o, m, l = loop(k.shape[1] // st.block_kv, step, init, (k, v))
  safe_l = jnp.where(l > 0, l, 1.0)
  lse = jnp.where(l > 0, m + jnp.log(safe_l), -jnp.inf)
  o = jnp.einsum("bkgqd->bqkgd", o / safe_l[..., None])
  return o.reshape(b, bq, kvh * g, dv), lse.reshape(b, kvh * g, bq)


# Named scopes mark the kernel's ops in profiles and compiled programs.
@jax.named_scope("ptx_blockwise_fwd")
def forward(q, k, v, mi: mask_lib.MaskInputs, st: Static, acc=None):
  """Blockwise forward: (out [B,T,H,Dv], lse [B,H,T]).

  Without `acc` the output is written in q.dtype. With `acc = (out f32, lse)`,
  the result over these keys is merged into it (the ring's running state).
  """
  q, k, v, mi = _tie(q, k, v, mi)
  b, t, h, d = q.shape
  kvh = k.shape[2]
  q5 = q.reshape(b, t, kvh, h // kvh, d)
  merge = acc is not None
  if not merge:
    acc = vary_like((jnp.zeros((b, t, h, v.shape[-1]), q.dtype),
                     jnp.zeros((b, h, t), jnp.float32)), q, k, v, mi)

  def step(i, acc, qkv):
    q5, k, v = qkv
    out, lse = acc
    q_i = _tile(q5, i * st.block_q, st.block_q)
    o_i, lse_i = _attend_tile(q_i, k, v, mi, i, st)
    if merge:
      prev_o = _tile(out, i * st.block_q, st.block_q)
      prev_l = lax.dynamic_slice_in_dim(lse, i * st.block_q, st.block_q, 2)
      o_i, lse_i = lse_lib.merge_lse([prev_o, o_i], [prev_l, lse_i])
    out = update_along(out, o_i, i * st.block_q, 1)
    return out, update_along(lse, lse_i, i * st.block_q, 2)

  return loop(t // st.block_q, step, acc, (q5, k, v))


@jax.named_scope("ptx_blockwise_bwd")
def backward(q, k, v, mi: mask_lib.MaskInputs, st: Static, lse, delta, dout,
             grads):
  """Blockwise backward; adds into `grads = (dq, dk, dv)` (float32) and returns them.

  `lse` and `delta = rowsum(out * dout) - dlse` ([B, H, T]) must describe the
  full attention (all keys), which makes a partial key set exact for the ring.
  """
  q, k, v, mi = _tie(q, k, v, mi)
  b, t, h, d = q.shape
  kvh = k.shape[2]
  g = h // kvh
  q5 = q.reshape(b, t, kvh, g, d)
  do5 = dout.reshape(b, t, kvh, g, -1)
  lse4 = lse.reshape(b, kvh, g, t)
  delta4 = delta.reshape(b, kvh, g, t)
  dq, dk, dv = grads
  dq = dq.reshape(b, t, kvh, g, d)
  bq, bk = st.block_q, st.block_kv

  def kv_step(j, carry, operands):
    k, v, q5, do5 = operands
    dq, dk, dv = carry
    k_j = _tile(k, j * bk, bk)
    v_j = _tile(v, j * bk, bk)

    def q_step(i, inner, q_do):
      q5, do5 = q_do
      ok = _tile_mask(mi, i, j, st)

      def compute(inner):
        dq, dk_j, dv_j = inner
        q_i = _tile(q5, i * bq, bq)
        do_i = _tile(do5, i * bq, bq)
        lse_i = lax.dynamic_slice_in_dim(lse4, i * bq, bq, 3)
        delta_i = lax.dynamic_slice_in_dim(delta4, i * bq, bq, 3)
        s, dcap = _logits(q_i, k_j, st)
        # Empty rows have lse = -inf; the mask zeroes them before exp.
        p = jnp.exp(jnp.where(ok, s - lse_i[..., None], -jnp.inf))
        dv_j += jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do_i.dtype), do_i,
                           preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i, v_j,
                        preferred_element_type=jnp.float32)
        ds = p * (dp - delta_i[..., None])
        if dcap is not None:
          ds *= dcap
        ds = (ds * st.scale).astype(q.dtype)
        dq_i = _tile(dq, i * bq, bq) + jnp.einsum(
            "bkgqs,bskd->bqkgd", ds, k_j, preferred_element_type=jnp.float32)
        dk_j += jnp.einsum("bkgqs,bqkgd->bskd", ds, q_i,
                           preferred_element_type=jnp.float32)
        return lax.dynamic_update_slice_in_dim(dq, dq_i, i * bq, 1), dk_j, dv_j

      return lax.cond(jnp.any(ok), compute, lambda c: c, inner)

    init = (dq, _tile(dk, j * bk, bk), _tile(dv, j * bk, bk))
    dq, dk_j, dv_j = loop(t // bq, q_step, init, (q5, do5))
    return (dq, lax.dynamic_update_slice_in_dim(dk, dk_j, j * bk, 1),
            lax.dynamic_update_slice_in_dim(dv, dv_j, j * bk, 1))

  dq, dk, dv = loop(k.shape[1] // bk, kv_step, (dq, dk, dv), (k, v, q5, do5))
  return dq.reshape(b, t, h, d), dk, dv


def delta_of(out, dout, dlse):
  """delta [B, H, T] = rowsum(out * dout) - dlse, in float32."""
  # An elementwise product and reduce fuses; an f32 einsum would first
  # materialise float32 copies of out and dout.
  rows = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
  return jnp.swapaxes(rows, 1, 2) - dlse.astype(jnp.float32)


def zero_grads(q, k, v, mi, dout):
  """Float32 zero accumulators for (dq, dk, dv)."""
  return vary_like(tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v)),
                   q, k, v, mi, dout)


def no_cotangent(mi: mask_lib.MaskInputs):
  """Zero cotangents for the integer mask inputs of a custom VJP."""
  return jax.tree.map(
      lambda x: jnp.zeros(x.shape, jax.dtypes.float0), mi)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attention(q, k, v, mi: mask_lib.MaskInputs, st: Static):
  """Blockwise attention (lengths must be tile multiples): (out, lse)."""
  return forward(q, k, v, mi, st)


def _attention_fwd(q, k, v, mi, st):
  """Forward rule: keeps only q, k, v, the mask inputs, out and lse."""
  out, lse = forward(q, k, v, mi, st)
  return (out, lse), (q, k, v, mi, out, lse)


def _attention_bwd(st, res, cts):
  """Backward rule: recomputes P tile by tile from the LSE."""
  q, k, v, mi, out, lse = res
  dout, dlse = cts
  dq, dk, dv = backward(q, k, v, mi, st, lse, delta_of(out, dout, dlse), dout,
                        zero_grads(q, k, v, mi, dout))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          no_cotangent(mi))


attention.defvjp(_attention_fwd, _attention_bwd)


def pad_to_tiles(x, multiple: int):
  """Pads axis 1 of x with zeros up to a multiple of `multiple`.

  Zero segment ids mark the padding, so padded tokens are never visible.
  """
  extra = -x.shape[1] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, extra)
  return jnp.pad(x, widths)
