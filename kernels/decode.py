"""Decode attention: a few new query tokens against a KV cache, at a cost that follows its filled part.

The cache is [B, S_max, KV, D]. Slot s of row b holds position
s - starts[b] and is valid for starts[b] <= s < lengths[b] (a left-padded
batch starts each row at its padding; the new tokens are already written).
Only the blocks of `block_kv` slots below max(lengths) are read: a loop with
a traced trip count runs an online softmax over them, so a decode step at
fill f costs O(f), not O(S_max). XLA:CPU copies each block out of the
cache before its products, so there the ptx sampler reads a single token's
cache in one block and keeps it near the fill (`xla_cpu_workarounds`).
An int8 cache is dequantised a block at a time. A cache of every layer
stacked ([L, B, S_max, KV, D], `layer` naming the one attended: a decode
step that scans the layers) is read a block at a time out of the stack, never
copied a layer at a time. A cache without values
(`v_cache` None) reads each block's values as the first `values_width`
columns of its keys: multi-head latent attention's absorbed decode, whose
one latent per slot is both. With a mesh, the cache is sharded along `axis_name`: every device runs
the same loop over the filled blocks of its slice, with global slot indices,
and the per-device partials (a few tokens each) are gathered and merged with
`merge_lse`; the cache itself never moves.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ptx_kernels import lse as lse_lib
from ptx_kernels import mask as mask_lib
from ptx_kernels import partition


def _filled_attention(q_BKGTD, cache, starts, lengths, q_pos, window, offset, layer, *, causal, softcap, scale,
                      block_kv, values_width):
  """Online softmax over the filled blocks of one cache slice (k, v, k_scale, v_scale; v None: values in k).

  The arrays are [B, KV, S, ...], or every layer's stacked, [L, B, KV, S, ...], of which `layer` is read (else
  None). Returns (out [B, KV, G, T, Dv] f32, lse [B, KV, G, T], the cache). The
  loop threads the cache through its carry untouched: a loop operand that
  stays live after the loop is copied into it by XLA, a carried one is not,
  so a caller that goes on with the returned cache never copies it.
  """
  b, kvh, g, t, _ = q_BKGTD.shape
  k_BKSD, v_BKSD = cache[:2]
  s_loc, dv = k_BKSD.shape[-2], values_width or v_BKSD.shape[-1]
  width = min(block_kv, s_loc)
  n_blocks = -(-s_loc // width)
  columns = jnp.arange(width, dtype=jnp.int32)

  def read_slots(x, start):
    if layer is None:
      return lax.dynamic_slice_in_dim(x, start, width, axis=2)
    # One slice of the stack: the block of the layer, with no copy of the layer's whole cache first.
    at = (layer, 0, 0, start) + (0,) * (x.ndim - 4)
    return lax.dynamic_slice(x, at, (1,) + x.shape[1:3] + (width,) + x.shape[4:])[0]

  def read(cache, scales, start):
    block = read_slots(cache, start)
    if scales is None:
      return block
    return block.astype(jnp.float32) * read_slots(scales, start)[..., None]

  def step(i, carry):
    (m, l, acc), (k_BKSD, v_BKSD, k_scale, v_scale) = carry
    # The last block is shifted back to stay inside the slice; slots that the
    # previous block already covered are masked out of it.
    start = jnp.minimum(i * width, s_loc - width)
    slots = offset + start + columns
    ok_BC = ((slots[None] >= starts[:, None]) & (slots[None] < lengths[:, None])
             & (start + columns >= i * width)[None])
    dist_BTC = q_pos[:, :, None] - (slots[None, None] - starts[:, None, None])
    ok = ok_BC[:, None]
    if causal:
      ok &= dist_BTC >= 0
    if window is not None:
      ok &= dist_BTC < window
    ok = ok[:, None, None]  # [B, 1, 1, T, C]
    k_i = read(k_BKSD, k_scale, start)
    v_i = k_i[..., :dv] if v_BKSD is None else read(v_BKSD, v_scale, start)
    s = jnp.einsum("bkgtd,bkcd->bkgtc", q_BKGTD, k_i.astype(q_BKGTD.dtype),
                   preferred_element_type=jnp.float32) * scale
    if softcap is not None:
      s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    decay = jnp.exp(m - m_safe)
    pv = jnp.einsum("bkgtc,bkcd->bkgtd", p.astype(v_i.dtype), v_i, preferred_element_type=jnp.float32)
    return (m_new, l * decay + jnp.sum(p, axis=-1), acc * decay[..., None] + pv), (k_BKSD, v_BKSD, k_scale, v_scale)

  init = (jnp.full((b, kvh, g, t), -jnp.inf, jnp.float32), jnp.zeros((b, kvh, g, t), jnp.float32),
          jnp.zeros((b, kvh, g, t, dv), jnp.float32))
  if n_blocks == 1:
    (m, l, acc), cache = step(0, (init, cache))
  else:
    filled = jnp.clip(jnp.max(lengths) - offset, 0, s_loc)
    (m, l, acc), cache = lax.fori_loop(0, (filled + width - 1) // width, step, (init, cache))
  safe = jnp.where(l > 0, l, 1.0)
  return acc / safe[..., None], jnp.where(l > 0, m + jnp.log(safe), -jnp.inf), cache


def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array | None, *,
    lengths: jax.Array, starts=None, q_positions=None, k_scale=None, v_scale=None,
    causal: bool = True, window=None, softcap: float | None = None, scale: float | None = None,
    block_kv: int = 512, mesh=None, axis_name: str = "seq",
    batch_axes: tuple[str, ...] = ("data", "fsdp"),
    head_axes: tuple[str, ...] = ("tensor",),
    return_cache: bool = False,
    values_width: int | None = None,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, ...]:
  """Attention of T new tokens per row over the filled part of a (possibly seq-sharded) KV cache.

  Args:
    q: queries [B, T, H, D] (T is small for sampling, a chunk for chunked
      prefill).
    k_cache: keys [B, S_max, KV, D], or int8 with `k_scale`.
    v_cache: values [B, S_max, KV, Dv], or int8 with `v_scale`; None: the
      values are the first `values_width` columns of the keys (and
      `v_scale` is None: the keys' scales serve them).
    lengths: int [B]: slots below lengths[b] may be valid, the T new tokens
      included; blocks at or past max(lengths) are never read.
    starts: int [B] first valid slot of each row; slot s holds position
      s - starts[b]. Default 0.
    q_positions: int [B, T]; default lengths - starts - T + arange(T) (the
      new tokens are the last ones written).
    k_scale, v_scale: float32 [B, S_max, KV] per-slot, per-head scales of an
      int8 cache (absmax / 127), or None.
    causal, window, softcap, scale: as in `flash_attention`.
    block_kv: cache slots per block of the loop.
    mesh: if given, the cache is sharded along `axis_name` of this mesh and
      the result is replicated along it.
    axis_name: mesh axis that shards S_max.
    batch_axes: mesh axes (those present with size > 1) that shard B.
    head_axes: mesh axes (those present with size > 1) that shard H and KV.
    return_cache: also return (k_cache, v_cache, k_scale, v_scale) as
      threaded through the block loop. A decode loop that carries these on,
      rather than its inputs, lets XLA update the cache in place; otherwise
      it copies the cache into the loop at every call.
    values_width: Dv of a cache without values (`v_cache` None).
    layer: None, or the cache arrays hold every layer's stacked before their
      own axes ([L, B, S_max, KV, D], scales [L, B, S_max, KV]) and this int
      (traced under a scan over the layers) names the layer attended; its
      blocks are read out of the stack in place.

  Returns:
    (out [B, T, H, Dv] in q.dtype, lse [B, H, T] float32), then the cache
    arrays with `return_cache` (stacked, as given).
  """
  stacked = 0 if layer is None else 1  # the axes before a layer's own
  layer_of = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape[stacked:], x.dtype)  # noqa: E731
  k_layer, v_layer = layer_of(k_cache), layer_of(v_cache)
  mask_lib.check_qkv(q, k_layer, v_layer, values_width)
  b, t, h, d = q.shape
  kvh = k_layer.shape[2]
  lengths = _row_ints(lengths, "lengths", b)
  starts = jnp.zeros((b,), jnp.int32) if starts is None else _row_ints(starts, "starts", b)
  paired = v_scale is None if v_cache is None else (k_scale is None) == (v_scale is None)
  if not paired or (k_scale is not None and k_scale.shape != k_cache.shape[:3 + stacked]):
    raise ValueError(f"k_scale and v_scale must both be None or {k_cache.shape[:3 + stacked]} (v_scale None for a "
                     "cache without values)")
  if q_positions is None:
    q_positions = (lengths - starts)[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None]
  window = mask_lib.check_window(window)
  n_dev = 1 if mesh is None else mesh.shape[axis_name]
  if k_layer.shape[1] % n_dev:
    raise ValueError(f"cache length {k_layer.shape[1]} must split into {n_dev} shards")
  settings = dict(causal=causal, softcap=softcap, scale=d ** -0.5 if scale is None else scale, block_kv=block_kv,
                  values_width=values_width if v_cache is None else None)
  # Heads before slots: every block is a batched [G*T, D] x [D, C] product per (row, kv head).
  q_BKGTD = q.reshape(b, t, kvh, h // kvh, d).transpose(0, 2, 3, 1, 4)
  swap = lambda x: None if x is None else jnp.swapaxes(x, 1 + stacked, 2 + stacked)  # noqa: E731
  cache = tuple(swap(x) for x in (k_cache, v_cache, k_scale, v_scale))

  def local(q, cache, starts, lengths, q_pos, window, layer, offset):
    out, lse, cache = _filled_attention(q, cache, starts, lengths, q_pos, window, offset, layer, **settings)
    # To the package layout: out [B, T, H, Dv], lse [B, H, T] (local sizes under shard_map).
    rows, heads = lse.shape[0], lse.shape[1] * lse.shape[2]
    return out.reshape(rows, heads, t, -1).transpose(0, 2, 1, 3), lse.reshape(rows, heads, t), cache

  args = (q_BKGTD, cache, starts, lengths, jnp.asarray(q_positions, jnp.int32), window, layer)
  if mesh is None:
    out, lse, cache = local(*args, 0)
  else:
    local_s = k_layer.shape[1] // n_dev

    def sharded(*args):
      out, lse, cache = local(*args, lax.axis_index(axis_name) * local_s)
      # The partials are a few tokens each: gathering them costs nothing next
      # to gathering the cache.
      outs = lax.all_gather(out, axis_name)
      lses = lax.all_gather(lse, axis_name)
      return (*lse_lib.merge_lse(list(outs), list(lses)), cache)

    bax = partition.present_axes(mesh, batch_axes)
    hax = partition.present_axes(mesh, head_axes)
    layers = (None,) * stacked
    cache_specs = (P(*layers, bax, hax, axis_name, None),) * 2 + (P(*layers, bax, hax, axis_name),) * 2
    cache_specs = tuple(None if x is None else spec for x, spec in zip(cache, cache_specs))
    in_specs = (P(bax, hax, None, None, None), cache_specs, P(bax), P(bax), P(bax, None),
                None if window is None else P(), None if layer is None else P())
    out, lse, cache = jax.shard_map(sharded, mesh=mesh, in_specs=in_specs,
                                    out_specs=(P(bax, None, hax, None), P(bax, hax, None), cache_specs),
                                    check_vma=False)(*args)
  if not return_cache:
    return out.astype(q.dtype), lse
  return out.astype(q.dtype), lse, tuple(swap(x) for x in cache)


def _row_ints(x, name: str, b: int) -> jax.Array:
  """Validates one int [B] array."""
  x = jnp.asarray(x)
  if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be int [{b}], got {x.dtype}{x.shape}")
  return x.astype(jnp.int32)
