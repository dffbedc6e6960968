"""Ring (context-parallel) attention over a sequence-sharded mesh axis.

Each device of the `seq` axis keeps its query shard and passes its key/value
shard around the ring with `ppermute`; after n steps every query has met every
key. Each step runs one flash kernel (`implementation.Kernel`: blockwise, or
the GPU or TPU Pallas kernel) on the local queries and the visiting shard. The
transfer of the next shard is issued before the current one is computed, so on
TPU/GPU the collective overlaps the kernel. Partial results fold into one
float32 accumulator through the LSE (`merge_lse`).

The backward is a custom VJP with the same O(T/n) residuals as the flash
kernels (local q, k, v, out, lse): key/value shards travel the ring again
together with their float32 dK/dV accumulators, each step adds the kernel's
backward given the global lse and delta, and after n hops each accumulator is
back on the device that owns the shard.

Heads run in passes (`heads_per_pass`): each pass is a whole ring over a
slice of the heads, so float32 accumulators (out in the forward; dQ and the
travelling dK/dV in the backward) exist for one pass's heads only. By default
a pass is one kv head with its query group, which moves no extra K/V; fewer
heads per pass send a kv head around the ring once per pass.

Masking uses global positions, so the kernel is layout-agnostic: `layout` only
chooses default positions. In the zig-zag layout (`to_zigzag`) device i holds
chunks i and 2n-1-i of 2n, which balances causal work across devices.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ptx_kernels import blockwise
from ptx_kernels import implementation
from ptx_kernels import mask as mask_lib
from ptx_kernels import partition
from ptx_kernels import xla_cpu_workarounds
from ptx_kernels.block_sizes import BlockSizes

LAYOUTS = ("contiguous", "zigzag")


def _zigzag_order(n: int) -> list[int]:
  """Chunk order of the zig-zag layout: 0, 2n-1, 1, 2n-2, ..."""
  return [c for i in range(n) for c in (i, 2 * n - 1 - i)]


def _reorder_chunks(x, n: int, axis: int, order: list[int]):
  """Splits an axis into 2n chunks and puts them in `order`."""
  length = x.shape[axis]
  if length % (2 * n):
    raise ValueError(f"axis {axis} length {length} is not a multiple of 2n={2 * n}")
  chunks = x.reshape(x.shape[:axis] + (2 * n, length // (2 * n)) + x.shape[axis + 1:])
  chunks = jnp.take(chunks, jnp.asarray(order), axis=axis)
  return chunks.reshape(x.shape)


def to_zigzag(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
  """Reorders a sequence axis so n contiguous shards hold chunks (i, 2n-1-i)."""
  return _reorder_chunks(x, n, axis, _zigzag_order(n))


def from_zigzag(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
  """Inverse of `to_zigzag`."""
  order = _zigzag_order(n)
  return _reorder_chunks(x, n, axis, sorted(range(2 * n), key=order.__getitem__))


def _rotate(tree, axis_name: str, n: int):
  """Sends every leaf of a tree to the next device of the ring."""
  perm = [(i, (i + 1) % n) for i in range(n)]

  def send(x):
    # XLA:CPU permutes bf16 through float32 copies of the whole shard; as uint16 the bits travel as they are.
    if x.dtype != jnp.bfloat16 or not xla_cpu_workarounds.active():
      return lax.ppermute(x, axis_name, perm)
    bits = lax.ppermute(lax.bitcast_convert_type(x, jnp.uint16), axis_name, perm)
    return lax.bitcast_convert_type(bits, jnp.bfloat16)

  return jax.tree.map(send, tree)


def _visiting(mi: mask_lib.MaskInputs, kv_seg, kv_pos) -> mask_lib.MaskInputs:
  """Mask inputs with the key side of the shard now held here."""
  return mi._replace(kv_segment_ids=kv_seg, kv_positions=kv_pos)


class Passes(NamedTuple):
  """How the local heads are split into ring passes (compile-time).

  Pass (c, s) attends q heads [c * kv_per_pass * g + s * heads, + heads) to kv
  heads [c * kv_per_pass, + kv_per_pass): only one pass's float32 accumulators
  are alive at a time.
  """

  heads: int  # q heads per pass
  kv_chunks: int  # passes over disjoint kv-head chunks
  kv_per_pass: int  # kv heads per pass
  sub: int  # passes per kv chunk (q heads of one kv head split further)


def _passes(h: int, kvh: int, heads_per_pass: int | None) -> Passes:
  """Validates heads_per_pass against H q heads and KV kv heads."""
  g = h // kvh
  hp = g if heads_per_pass is None else heads_per_pass
  if hp < 1 or h % hp or (hp % g if hp >= g else g % hp):
    raise ValueError(
        f"heads_per_pass={hp} must divide the {h} local q heads and be a "
        f"multiple or divisor of the group size {g}")
  kvp = max(hp // g, 1)
  return Passes(hp, kvh // kvp, kvp, max(g // hp, 1))


def _heads(x, start, size):
  """Heads [start, start + size) of x [B, T, H, D]."""
  return lax.dynamic_slice_in_dim(x, start, size, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ring(q, k, v, mi, st: blockwise.Static, axis_name: str, n: int,
          ps: Passes, kernel: implementation.Kernel):
  """Ring attention on the local shards (inside shard_map): (out, lse)."""
  return _ring_fwd(q, k, v, mi, st, axis_name, n, ps, kernel)[0]


def _pass_fwd(q, k, v, mi, st, axis_name, n, kernel):
  """n ring steps, each folding one key/value shard into the accumulator."""
  b, t, h, _ = q.shape
  acc = blockwise.vary_like((jnp.zeros((b, t, h, v.shape[-1]), jnp.float32),
                             jnp.full((b, h, t), -jnp.inf, jnp.float32)),
                            q, k, v, mi)

  def step(_, carry, q):
    acc, shard = carry
    nxt = _rotate(shard, axis_name, n)  # Issued first: overlaps the compute.
    acc = kernel.forward(q, shard[0], shard[1], _visiting(mi, *shard[2:]), st,
                         acc)
    return acc, nxt

  shard = (k, v, mi.kv_segment_ids, mi.kv_positions)
  acc, shard = blockwise.loop(n - 1, step, (acc, shard), q)
  return kernel.forward(q, shard[0], shard[1], _visiting(mi, *shard[2:]), st,
                        acc)


def _ring_fwd(q, k, v, mi, st, axis_name, n, ps, kernel):
  """One ring per head pass, written into the (out, lse) buffers."""
  b, t, h, _ = q.shape
  g = h // k.shape[2]
  out_lse = blockwise.vary_like(
      (jnp.zeros((b, t, h, v.shape[-1]), q.dtype),
       jnp.zeros((b, h, t), jnp.float32)), q, k, v, mi)

  def one_pass(p, out_lse, qkv):
    q, k, v = qkv
    c, s = p // ps.sub, p % ps.sub
    qh = c * ps.kv_per_pass * g + s * ps.heads
    kv = lambda x: _heads(x, c * ps.kv_per_pass, ps.kv_per_pass)
    o, l = _pass_fwd(_heads(q, qh, ps.heads), kv(k), kv(v), mi, st,
                     axis_name, n, kernel)
    out, lse = out_lse
    return (blockwise.update_along(out, o, qh, 2),
            blockwise.update_along(lse, l, qh, 1))

  out, lse = blockwise.loop(ps.kv_chunks * ps.sub, one_pass, out_lse, (q, k, v))
  return (out, lse), (q, k, v, mi, out, lse)


def _pass_bwd(q, k, v, mi, st, axis_name, n, kernel, lse, delta, dout, dkv):
  """n ring steps of one pass; dK/dV travel with their shard back home.

  Returns (dq float32, dkv): `dkv` (float32, this pass's kv heads) comes back
  to its owner with this pass's contribution added.
  """
  def grads(dq, shard, dkv, q, dout):
    return kernel.backward(
        q, shard[0], shard[1], _visiting(mi, *shard[2:]), st, lse, delta, dout,
        (dq, *dkv))

  def step(_, carry, q_do):
    dq, shard, dkv = carry
    nxt = _rotate(shard, axis_name, n)  # Issued first: overlaps the compute.
    dq, dk, dv = grads(dq, shard, dkv, *q_do)
    return dq, nxt, _rotate((dk, dv), axis_name, n)

  dq = blockwise.vary_like(jnp.zeros(q.shape, jnp.float32), q, k, v, mi, dout)
  shard = (k, v, mi.kv_segment_ids, mi.kv_positions)
  dq, shard, dkv = blockwise.loop(n - 1, step, (dq, shard, dkv), (q, dout))
  # The last shard's k/v need no further hop, only its gradients do.
  dq, dk, dv = grads(dq, shard, dkv, q, dout)
  return dq, _rotate((dk, dv), axis_name, n)


def _ring_bwd(st, axis_name, n, ps, kernel, res, cts):
  """One backward ring per head pass; dK/dV of a kv chunk sum over its passes."""
  q, k, v, mi, out, lse = res
  dout, dlse = cts
  delta = blockwise.delta_of(out, dout, dlse)
  g = q.shape[2] // k.shape[2]
  grads = blockwise.vary_like(tuple(jnp.zeros_like(x) for x in (q, k, v)),
                              q, k, v, mi, dout)

  def kv_chunk(c, grads, operands):
    q, k, v, dout = operands
    kv = lambda x: _heads(x, c * ps.kv_per_pass, ps.kv_per_pass)
    k_c, v_c = kv(k), kv(v)

    def sub_pass(s, carry, q_do):
      q, dout = q_do
      dq_all, dkv = carry
      qh = c * ps.kv_per_pass * g + s * ps.heads
      qs = lambda x: _heads(x, qh, ps.heads)
      rows = lambda x: lax.dynamic_slice_in_dim(x, qh, ps.heads, 1)
      dq, dkv = _pass_bwd(qs(q), k_c, v_c, mi, st, axis_name, n, kernel,
                          rows(lse), rows(delta), qs(dout), dkv)
      return blockwise.update_along(dq_all, dq, qh, 2), dkv

    dq, dk, dv = grads
    dkv = tuple(jnp.zeros(x.shape, jnp.float32) for x in (k_c, v_c))
    dkv = blockwise.vary_like(dkv, k_c, v_c, mi, dout)
    dq, (dk_c, dv_c) = blockwise.loop(ps.sub, sub_pass, (dq, dkv), (q, dout))
    dk = blockwise.update_along(dk, dk_c, c * ps.kv_per_pass, 2)
    return dq, dk, blockwise.update_along(dv, dv_c, c * ps.kv_per_pass, 2)

  dq, dk, dv = blockwise.loop(ps.kv_chunks, kv_chunk, grads, (q, k, v, dout))
  return dq, dk, dv, blockwise.no_cotangent(mi)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, mesh=None,
    axis_name: str = "seq", layout: str = "contiguous", q_segment_ids=None,
    kv_segment_ids=None, q_positions=None, kv_positions=None,
    causal: bool = True, window=None, softcap: float | None = None,
    scale: float | None = None, block_sizes: BlockSizes | None = None,
    batch_axes: tuple[str, ...] = ("data", "fsdp"),
    head_axes: tuple[str, ...] = ("tensor",),
    heads_per_pass: int | None = None, impl: str = "blockwise",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Context-parallel attention: the sequence axis is sharded over `axis_name`.

  Args:
    q: queries [B, T, H, D], in `layout` order along T.
    k: keys [B, T, KV, D] (self-attention: same length and order as q).
    v: values [B, T, KV, Dv].
    mesh: the device mesh; default the one set with `jax.set_mesh`.
    axis_name: mesh axis that shards the sequence.
    layout: "contiguous" (natural order) or "zigzag" (arrays already passed
      through `to_zigzag(x, mesh.shape[axis_name])`); only sets the default
      positions.
    q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal, window,
      softcap, scale: as in `flash_attention`; positions are global token
      positions in the same order as the arrays.
    block_sizes: tiles of the kernel that each ring step runs.
    batch_axes: mesh axes (those present with size > 1) that shard B.
    head_axes: mesh axes (those present with size > 1) that shard H and KV.
    heads_per_pass: local q heads per ring pass (a multiple or divisor of the
      group size H / KV); default one kv head and its q heads per pass. Each
      pass runs the whole ring, so float32 accumulators exist for one pass's
      heads only; fewer heads per pass trade K/V traffic for memory.
    impl: the kernel of each ring step, as in `flash_attention`: "blockwise",
      "pallas_gpu", "pallas_tpu" or "auto" (the default backend's Pallas
      kernel, blockwise on CPU).
    interpret: run a Pallas kernel through the Pallas interpreter (on CPU).

  Returns:
    (out [B, T, H, Dv], lse [B, H, T]), sharded along T over `axis_name`, in
    the input order.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  kernel = implementation.choose(impl, interpret)
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if axis_name not in mesh.axis_names:
    raise ValueError(f"mesh axes {mesh.axis_names} lack {axis_name!r}")
  mask_lib.check_qkv(q, k, v)
  kernel.check(q, v)
  b, t, h, d = q.shape
  if k.shape[1] != t:
    raise ValueError(f"ring attention needs S == T, got {k.shape[1]} != {t}")
  n = mesh.shape[axis_name]
  if t % (n if layout == "contiguous" else 2 * n):
    raise ValueError(f"T={t} must split evenly for {layout} over {n} devices")
  if layout == "zigzag" and q_positions is None:
    q_positions = kv_positions = jnp.broadcast_to(
        to_zigzag(jnp.arange(t, dtype=jnp.int32), n, axis=0), (b, t))
  mi = mask_lib.make_mask_inputs(
      b, t, t, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_positions=q_positions, kv_positions=kv_positions, window=window)
  st = kernel.static(block_sizes, t // n, t // n, d, q.dtype, causal=causal,
                     softcap=softcap, scale=scale)
  bax = partition.present_axes(mesh, batch_axes)
  hax = partition.present_axes(mesh, head_axes)
  x_spec, ids_spec = P(bax, axis_name, hax, None), P(bax, axis_name)
  mi_spec = mask_lib.MaskInputs(
      ids_spec, ids_spec, ids_spec, ids_spec, None if mi.window is None else P())

  def local(q, k, v, mi):
    tl = q.shape[1]
    pad = blockwise.pad_to_tiles
    mi = mask_lib.MaskInputs(
        pad(mi.q_segment_ids, st.block_q), pad(mi.kv_segment_ids, st.block_kv),
        pad(mi.q_positions, st.block_q), pad(mi.kv_positions, st.block_kv),
        mi.window)
    ps = _passes(q.shape[2], k.shape[2], heads_per_pass)
    out, lse = _ring(pad(q, st.block_q), pad(k, st.block_kv),
                     pad(v, st.block_kv), mi, st, axis_name, n, ps, kernel)
    return out[:, :tl], lse[:, :, :tl]

  return jax.shard_map(
      local, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, mi_spec),
      out_specs=(x_spec, P(bax, hax, axis_name)),
      check_vma=kernel.checks_vma)(q, k, v, mi)
