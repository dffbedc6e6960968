"""The one attention entry point of the models, and its XLA implementation.

Masking is defined by segment ids and positions alone, so the same call
serves packed training batches, KV-cache decoding and sequence-sharded
layouts: query t sees key s when they share a segment id, when
`kv_position[s] <= q_position[t]` (causal), and, with a sliding window, when
`q_position[t] - kv_position[s] < window`. A query that sees no key at all
returns zeros, never NaN.

Shapes: q [B, T, H, K]; k, v [B, S, N, K] with H a multiple of N (grouped
queries share a KV head without K/V being repeated).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# Large but finite, so that masked logits never produce inf - inf = NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array,
    positions: jax.Array,
    impl: str = "xla",
    kv_segment_ids: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
  """Causal grouped-query attention with packing, windows and soft-capping.

  Args:
    q: queries [B, T, H, K].
    k: keys [B, S, N, K].
    v: values [B, S, N, K].
    segment_ids: int32 [B, T] segment of each query (0 marks padding).
    positions: int32 [B, T] position of each query within its sequence.
    impl: the implementation; see IMPLEMENTATIONS.
    kv_segment_ids: int32 [B, S]; defaults to `segment_ids` (self-attention).
    kv_positions: int32 [B, S]; defaults to `positions`.
    window: sliding-window size in tokens (a Python int or a traced int32
      scalar, as per-layer windows are scanned); None attends to all the past.
    softcap: tanh soft-cap on the logits, `cap * tanh(logits / cap)`.
    scale: logit scale; defaults to K ** -0.5.

  Returns:
    The attention output [B, T, H, K] in the dtype of `q`.
  """
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention impl {impl!r} is not one of {sorted(IMPLEMENTATIONS)}")
  B, T, H, K = q.shape
  if k.shape != v.shape or k.shape[0] != B or k.shape[3] != K or H % k.shape[2]:
    raise ValueError(f"attention: q {q.shape} is incompatible with k {k.shape} / v {v.shape}")
  kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
  kv_positions = positions if kv_positions is None else kv_positions
  scale = K**-0.5 if scale is None else scale
  return IMPLEMENTATIONS[impl](
      q, k, v, segment_ids, kv_segment_ids, positions, kv_positions, window, softcap, scale)


def attention_mask(
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    window: jax.Array | int | None,
) -> jax.Array:
  """Returns the boolean [B, T, S] mask: same segment, causal, inside the window."""
  q_pos, kv_pos = q_positions[:, :, None], kv_positions[:, None, :]
  mask = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (kv_pos <= q_pos)
  if window is not None:
    mask &= q_pos - kv_pos < window
  return mask


def _xla_attention(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, softcap, scale):
  """Materialises the [T, S] logits: the reference implementation."""
  B, T, H, K = q.shape
  N = k.shape[2]
  q_BTNGK = q.reshape(B, T, N, H // N, K)
  # Logits and softmax in float32 whatever the compute dtype.
  logits = jnp.einsum("btngk,bsnk->bngts", q_BTNGK, k, preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  mask = attention_mask(q_seg, kv_seg, q_pos, kv_pos, window)[:, None, None]
  probs = jax.nn.softmax(jnp.where(mask, logits, _MASK_VALUE), axis=-1)
  probs = jnp.where(mask, probs, 0.0)  # rows without a visible key output 0
  out = jnp.einsum("bngts,bsnk->btngk", probs.astype(v.dtype), v)
  return out.reshape(B, T, H, K)


IMPLEMENTATIONS: dict[str, Callable[..., jax.Array]] = {"xla": _xla_attention}
