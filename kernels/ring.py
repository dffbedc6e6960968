"""Ring (context-parallel) attention over a sequence-sharded mesh axis.

Each device of the `seq` axis keeps its query shard and passes its key/value
shard around the ring with `ppermute`; after n steps every query has met every
key. The transfer of the next shard is issued before the current one is
computed, so on TPU/GPU the collective overlaps the blockwise kernel. Partial
results fold into one float32 accumulator through `merge_lse`.

The backward is a custom VJP with the same O(T/n) residuals as the blockwise
kernel (local q, k, v, out, lse): key/value shards travel the ring again
together with their float32 dK/dV accumulators, and after n hops each
accumulator is back on the device that owns the shard.

Masking uses global positions, so the kernel is layout-agnostic: `layout` only
chooses default positions. In the zig-zag layout (`to_zigzag`) device i holds
chunks i and 2n-1-i of 2n, which balances causal work across devices.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ptx_kernels import blockwise
from ptx_kernels import mask as mask_lib
from ptx_kernels import partition
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
  return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def _visiting(mi: mask_lib.MaskInputs, kv_seg, kv_pos) -> mask_lib.MaskInputs:
  """Mask inputs with the key side of the shard now held here."""
  return mi._replace(kv_segment_ids=kv_seg, kv_positions=kv_pos)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, mi, st: blockwise.Static, axis_name: str, n: int):
  """Ring attention on the local shards (inside shard_map): (out, lse)."""
  return _ring_fwd(q, k, v, mi, st, axis_name, n)[0]


def _ring_fwd(q, k, v, mi, st, axis_name, n):
  """n ring steps, each folding one key/value shard into the accumulator."""
  b, t, h, _ = q.shape
  acc = blockwise.vary_like((jnp.zeros((b, t, h, v.shape[-1]), jnp.float32),
                             jnp.full((b, h, t), -jnp.inf, jnp.float32)),
                            q, k, v, mi)

  def step(_, carry):
    acc, shard = carry
    nxt = _rotate(shard, axis_name, n)  # Issued first: overlaps the compute.
    acc = blockwise.forward(q, shard[0], shard[1], _visiting(mi, *shard[2:]),
                            st, acc=acc)
    return acc, nxt

  shard = (k, v, mi.kv_segment_ids, mi.kv_positions)
  acc, shard = lax.fori_loop(0, n - 1, step, (acc, shard))
  out, lse = blockwise.forward(q, shard[0], shard[1], _visiting(mi, *shard[2:]),
                               st, acc=acc)
  out = out.astype(q.dtype)
  return (out, lse), (q, k, v, mi, out, lse)


def _ring_bwd(st, axis_name, n, res, cts):
  """n ring steps; dK/dV travel with their shard and end at its owner."""
  q, k, v, mi, out, lse = res
  dout, dlse = cts
  delta = blockwise.delta_of(out, dout, dlse)

  def grads(dq, shard, dkv):
    return blockwise.backward(
        q, shard[0], shard[1], _visiting(mi, *shard[2:]), st, lse, delta, dout,
        (dq, *dkv))

  def step(_, carry):
    dq, shard, dkv = carry
    nxt = _rotate(shard, axis_name, n)  # Issued first: overlaps the compute.
    dq, dk, dv = grads(dq, shard, dkv)
    return dq, nxt, _rotate((dk, dv), axis_name, n)

  dq, dk, dv = blockwise.zero_grads(q, k, v, mi, dout)
  shard = (k, v, mi.kv_segment_ids, mi.kv_positions)
  dq, shard, dkv = lax.fori_loop(0, n - 1, step, (dq, shard, (dk, dv)))
  # The last shard's k/v need no further hop, only its gradients do.
  dq, dk, dv = grads(dq, shard, dkv)
  dk, dv = _rotate((dk, dv), axis_name, n)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          blockwise.no_cotangent(mi))


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, mesh=None,
    axis_name: str = "seq", layout: str = "contiguous", q_segment_ids=None,
    kv_segment_ids=None, q_positions=None, kv_positions=None,
    causal: bool = True, window=None, softcap: float | None = None,
    scale: float | None = None, block_sizes: BlockSizes | None = None,
    batch_axes: tuple[str, ...] = ("data", "fsdp"),
    head_axes: tuple[str, ...] = ("tensor",),
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
    block_sizes: tiles of the per-device blockwise kernel.
    batch_axes: mesh axes (those present with size > 1) that shard B.
    head_axes: mesh axes (those present with size > 1) that shard H and KV.

  Returns:
    (out [B, T, H, Dv], lse [B, H, T]), sharded along T over `axis_name`, in
    the input order.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if axis_name not in mesh.axis_names:
    raise ValueError(f"mesh axes {mesh.axis_names} lack {axis_name!r}")
  mask_lib.check_qkv(q, k, v)
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
  tiles = (block_sizes or BlockSizes()).clamp(t // n, t // n)
  st = blockwise.Static(
      causal=causal, softcap=None if softcap is None else float(softcap),
      scale=d ** -0.5 if scale is None else float(scale),
      block_q=tiles.block_q, block_kv=tiles.block_kv)
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
    out, lse = _ring(pad(q, st.block_q), pad(k, st.block_kv),
                     pad(v, st.block_kv), mi, st, axis_name, n)
    return out[:, :tl], lse[:, :, :tl]

  return jax.shard_map(
      local, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, mi_spec),
      out_specs=(x_spec, P(bax, hax, axis_name)),
  )(q, k, v, mi)
