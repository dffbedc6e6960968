"""Decode attention: a few new query tokens against a KV cache.

The cache is [B, S_max, KV, D] with slot s holding position s; `lengths[b]`
slots are valid (the new tokens already written). The cache is cut into splits
of `block_kv` slots, each split is attended on its own (skipped when no row can
see it, e.g. beyond every length) and the partials are merged with `merge_lse`.
With a mesh, the cache is sharded along `axis_name`: every device attends to
its slice with global positions and the per-device partials (a few tokens
each) are gathered and merged the same way.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ptx_kernels import lse as lse_lib
from ptx_kernels import mask as mask_lib
from ptx_kernels import partition


def _split_attention(q5, k, v, lengths, q_pos, offset, window, *, causal,
                     softcap, scale, block_kv):
  """Partials over one cache slice: (out [n, B, T, H, Dv] f32, lse [n, B, H, T])."""
  b, t, kvh, g, _ = q5.shape
  n = k.shape[1] // block_kv

  def split(i):
    start = i * block_kv
    kv_pos = offset + start + jnp.arange(block_kv, dtype=jnp.int32)
    ok = kv_pos[None, None, :] < lengths[:, None, None]
    dist = q_pos[:, :, None] - kv_pos[None, None, :]
    if causal:
      ok &= dist >= 0
    if window is not None:
      ok &= dist < window
    ok = ok[:, None, None]  # [B, 1, 1, T, C]

    def compute(_):
      k_i = lax.dynamic_slice_in_dim(k, start, block_kv, 1)
      v_i = lax.dynamic_slice_in_dim(v, start, block_kv, 1)
      s = jnp.einsum("btkgd,bckd->bkgtc", q5, k_i,
                     preferred_element_type=jnp.float32) * scale
      if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
      s = jnp.where(ok, s, -jnp.inf)
      m = jnp.max(s, axis=-1, keepdims=True)
      p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
      total = jnp.sum(p, axis=-1)
      safe = jnp.where(total > 0, total, 1.0)
      o = jnp.einsum("bkgtc,bckd->btkgd", (p / safe[..., None]).astype(v.dtype),
                     v_i, preferred_element_type=jnp.float32)
      lse = jnp.where(total > 0, m[..., 0] + jnp.log(safe), -jnp.inf)
      return o.reshape(b, t, kvh * g, -1), lse.reshape(b, kvh * g, t)

    def skip(_):
      return (jnp.zeros((b, t, kvh * g, v.shape[-1]), jnp.float32),
              jnp.full((b, kvh * g, t), -jnp.inf, jnp.float32))

    return lax.cond(jnp.any(ok), compute, skip, None)

  return lax.map(split, jnp.arange(n))


def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *,
    lengths: jax.Array, q_positions=None, causal: bool = True, window=None,
    softcap: float | None = None, scale: float | None = None,
    block_kv: int = 512, mesh=None, axis_name: str = "seq",
    batch_axes: tuple[str, ...] = ("data", "fsdp"),
    head_axes: tuple[str, ...] = ("tensor",),
) -> tuple[jax.Array, jax.Array]:
  """Attention of T new tokens per row over a (possibly seq-sharded) KV cache.

  Args:
    q: queries [B, T, H, D] (T is small: 1 for sampling, a few for
      speculative or chunked steps).
    k_cache: keys [B, S_max, KV, D]; slot s holds position s.
    v_cache: values [B, S_max, KV, Dv].
    lengths: int [B] valid slots per row, including the T new tokens.
    q_positions: int [B, T]; default lengths - T + arange(T) (the new tokens
      are the last ones written).
    causal, window, softcap, scale: as in `flash_attention`.
    block_kv: cache slots per split; must divide the (per-device) cache.
    mesh: if given, the cache is sharded along `axis_name` of this mesh and
      the result is replicated along it.
    axis_name: mesh axis that shards S_max.
    batch_axes: mesh axes (those present with size > 1) that shard B.
    head_axes: mesh axes (those present with size > 1) that shard H and KV.

  Returns:
    (out [B, T, H, Dv] in q.dtype, lse [B, H, T] float32).
  """
  mask_lib.check_qkv(q, k_cache, v_cache)
  b, t, h, d = q.shape
  kvh = k_cache.shape[2]
  lengths = jnp.asarray(lengths)
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths must be int [{b}], got {lengths.dtype}{lengths.shape}")
  lengths = lengths.astype(jnp.int32)
  if q_positions is None:
    q_positions = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None]
  mi = mask_lib.make_mask_inputs(b, t, 1, q_positions=q_positions,
                                 kv_positions=jnp.zeros((b, 1), jnp.int32),
                                 window=window)
  n_dev = 1 if mesh is None else mesh.shape[axis_name]
  local_s = k_cache.shape[1] // n_dev
  if k_cache.shape[1] % n_dev or local_s % min(block_kv, local_s):
    raise ValueError(f"cache length {k_cache.shape[1]} must split into "
                     f"{n_dev} shard(s) of whole {block_kv}-slot blocks")
  settings = dict(causal=causal, softcap=softcap,
                  scale=d ** -0.5 if scale is None else scale,
                  block_kv=min(block_kv, local_s))
  q5 = q.reshape(b, t, kvh, h // kvh, d)

  def local(q5, k, v, lengths, q_pos, window, offset):
    outs, lses = _split_attention(q5, k, v, lengths, q_pos, offset, window,
                                  **settings)
    return lse_lib.merge_lse(list(outs), list(lses))

  if mesh is None:
    out, lse = local(q5, k_cache, v_cache, lengths, mi.q_positions, mi.window, 0)
    return out.astype(q.dtype), lse

  def sharded(q5, k, v, lengths, q_pos, window):
    offset = lax.axis_index(axis_name) * local_s
    out, lse = local(q5, k, v, lengths, q_pos, window, offset)
    # The partials are a few tokens each: gathering them costs nothing next
    # to gathering the cache.
    outs = lax.all_gather(out, axis_name)
    lses = lax.all_gather(lse, axis_name)
    return lse_lib.merge_lse(list(outs), list(lses))

  bax = partition.present_axes(mesh, batch_axes)
  hax = partition.present_axes(mesh, head_axes)
  cache_spec = P(bax, axis_name, hax, None)
  window_spec = None if mi.window is None else P()
  out, lse = jax.shard_map(
      sharded, mesh=mesh,
      in_specs=(P(bax, None, hax, None, None), cache_spec, cache_spec, P(bax),
                P(bax, None), window_spec),
      out_specs=(P(bax, None, hax, None), P(bax, hax, None)), check_vma=False,
  )(q5, k_cache, v_cache, lengths, mi.q_positions, mi.window)
  return out.astype(q.dtype), lse
