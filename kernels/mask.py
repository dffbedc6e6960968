"""Attention visibility: which keys each query token may see.

Every implementation in ptx_kernels derives its mask from the same four int32
arrays and one window, so packing, ring layouts and KV caches share one rule:

  key s is visible to query t  iff
    q_segment_ids[t] == kv_segment_ids[s] != 0            (packing; 0 = padding)
    and (not causal or q_positions[t] >= kv_positions[s])
    and (window is None or q_positions[t] - kv_positions[s] < window)

Positions are explicit (global token indices), so a shard of a ring, a zig-zag
chunk or a decode step against a cache all use the same predicate. The window
bounds distance to past keys only; with causal=False, future keys stay visible.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class MaskInputs(NamedTuple):
  """The per-token arrays that define visibility (a pytree of int32 arrays)."""

  q_segment_ids: jax.Array  # int32 [B, T]
  kv_segment_ids: jax.Array  # int32 [B, S]
  q_positions: jax.Array  # int32 [B, T]
  kv_positions: jax.Array  # int32 [B, S]
  window: jax.Array | None  # int32 [] or None (no window)


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array | None, values_width: int | None = None) -> None:
  """Raises ValueError unless q [B,T,H,D], k [B,S,KV,D], v [B,S,KV,Dv] agree.

  v None: the values are the first `values_width` columns of k (a latent cache), 1 <= values_width <= D.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x is not None and x.ndim != 4:
      raise ValueError(
          f"{name} must be [batch, seq, heads, head_dim], got shape {x.shape}")
  if v is None:
    check_values_width(values_width, k.shape[3])
  if v is not None and k.shape[:3] != v.shape[:3]:
    raise ValueError(f"k {k.shape} and v {v.shape} differ in [batch, seq, heads]")
  if q.shape[0] != k.shape[0]:
    raise ValueError(f"batch differs: q {q.shape}, k {k.shape}")
  if q.shape[3] != k.shape[3]:
    raise ValueError(f"head_dim differs: q {q.shape}, k {k.shape}")
  if q.shape[2] % k.shape[2]:
    raise ValueError(
        f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")


def check_values_width(values_width, key_width: int) -> None:
  """Raises ValueError unless values read as the keys' first columns (no value array) have a width in [1, key_width]."""
  if not (isinstance(values_width, int) and 1 <= values_width <= key_width):
    raise ValueError(f"without a value array the values are the first values_width columns of the keys: "
                     f"values_width must be in [1, {key_width}], got {values_width!r}")


def _ids(x, name: str, shape: tuple[int, int]) -> jax.Array:
  """Validates one [B, L] int array."""
  x = jnp.asarray(x)
  if x.shape != shape:
    raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got {x.dtype}")
  return x.astype(jnp.int32)


def make_mask_inputs(
    batch: int, q_len: int, kv_len: int, *, q_segment_ids=None,
    kv_segment_ids=None, q_positions=None, kv_positions=None, window=None,
) -> MaskInputs:
  """Validates the mask arrays and fills defaults (one segment, arange)."""
  qs, ks = (batch, q_len), (batch, kv_len)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
  if q_segment_ids is None:
    q_segment_ids = jnp.ones(qs, jnp.int32)
    kv_segment_ids = jnp.ones(ks, jnp.int32)
  if (q_positions is None) != (kv_positions is None):
    raise ValueError("pass both q_positions and kv_positions, or neither")
  if q_positions is None:
    q_positions = jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32), qs)
    kv_positions = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), ks)
  return MaskInputs(
      _ids(q_segment_ids, "q_segment_ids", qs),
      _ids(kv_segment_ids, "kv_segment_ids", ks),
      _ids(q_positions, "q_positions", qs),
      _ids(kv_positions, "kv_positions", ks),
      check_window(window))


def check_window(window) -> jax.Array | None:
  """Validates a window: None, a positive Python int, or an int32 scalar."""
  if window is None:
    return None
  if isinstance(window, int):
    if window < 1:
      raise ValueError(f"window must be >= 1 or None, got {window}")
    return jnp.int32(window)
  window = jnp.asarray(window)
  if window.shape != () or not jnp.issubdtype(window.dtype, jnp.integer):
    raise ValueError(
        f"window must be an int or an int32 scalar, got {window.dtype}{window.shape}")
  return window.astype(jnp.int32)


def visible(
    q_seg: jax.Array, kv_seg: jax.Array, q_pos: jax.Array, kv_pos: jax.Array,
    *, causal: bool, window: jax.Array | None,
) -> jax.Array:
  """Boolean [B, Tq, Sk] visibility of keys for queries (module docstring)."""
  qs, ks = q_seg[:, :, None], kv_seg[:, None, :]
  ok = (qs == ks) & (qs != 0)
  dist = q_pos[:, :, None] - kv_pos[:, None, :]
  if causal:
    ok &= dist >= 0
  if window is not None:
    ok &= dist < window
  return ok


def key_bounds(mi: MaskInputs, causal: bool) -> tuple[jax.Array, jax.Array]:
  """Each query's visible key positions as an interval (lo, hi], int32 [B, T].

  Equivalent to the position part of `visible` (segments are checked apart):
  kernels compare two vectors instead of carrying a traced window scalar.
  """
  limits = jnp.iinfo(jnp.int32)
  pos = mi.q_positions
  hi = pos if causal else jnp.full_like(pos, limits.max)
  lo = jnp.full_like(pos, limits.min) if mi.window is None else pos - mi.window
  return lo, hi


def tile_summaries(mi: MaskInputs, lo: jax.Array, hi: jax.Array,
                   block_q: int, block_kv: int) -> tuple[jax.Array, jax.Array]:
  """Per-tile bounds that let a kernel skip tiles no query can see.

  Returns int32 q [B, T/block_q, 4] (min seg, max seg, min lo, max hi) and kv
  [B, S/block_kv, 4] (min seg, max seg, min pos, max pos), over non-padding
  tokens only. `tiles_may_see` on one row of each is a conservative test:
  False guarantees the whole tile pair is masked.
  """
  limits = jnp.iinfo(jnp.int32)

  def summarize(seg, low, high, block):
    b, n = seg.shape
    tiles = lambda x: x.reshape(b, n // block, block)
    live = tiles(seg) != 0
    least = lambda x: jnp.min(jnp.where(live, tiles(x), limits.max), axis=-1)
    most = lambda x: jnp.max(jnp.where(live, tiles(x), limits.min), axis=-1)
    return jnp.stack([least(seg), most(seg), least(low), most(high)], axis=-1)

  return (summarize(mi.q_segment_ids, lo, hi, block_q),
          summarize(mi.kv_segment_ids, mi.kv_positions, mi.kv_positions, block_kv))


def tiles_may_see(q_tile, kv_tile):
  """Whether a query tile may see a key tile, from `tile_summaries` rows."""
  return ((q_tile[0] <= kv_tile[1]) & (kv_tile[0] <= q_tile[1])
          & (kv_tile[2] <= q_tile[3]) & (kv_tile[3] > q_tile[2]))
