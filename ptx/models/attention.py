"""The one attention entry point of the models; implementations live in `ptx_kernels`.

Masking is defined by segment ids and positions alone (`ptx_kernels.mask`),
so the same call serves packed training batches, KV-cache decoding and
sequence-sharded layouts: query t sees key s when they share a non-zero
segment id, when `kv_position[s] <= q_position[t]` (causal), and, with a
sliding window, when `q_position[t] - kv_position[s] < window`. A query that
sees no key returns zeros, never NaN.

Implementations (`impl`):
  xla        materialised [T, S] logits (`dense_attention`): fastest for short sequences
  blockwise  pure-JAX flash attention with an O(T) custom VJP (the CPU choice)
  pallas     the Pallas kernel of the backend (GPU: Triton-style, TPU: Mosaic)
  ring       context parallelism: K/V blocks rotate over the `seq` mesh axis
  auto       pallas on GPU and TPU, blockwise on CPU

Shapes: q [B, T, H, K]; k, v [B, S, N, K] with H a multiple of N (grouped
queries share a KV head without K/V being repeated).

Known limit: blockwise (and so auto on CPU) bounds its tile loops by each
row's positions and segments. When GSPMD shards the batch over several
devices and inserts collectives inside those loops, devices can run different
trip counts and deadlock (seen on 8 CPU devices with ragged, left-padded
rollouts). Until the kernel runs per device under shard_map, models default
to "xla"; ring already runs under shard_map.
"""

from __future__ import annotations

import jax
import ptx_kernels

IMPLEMENTATIONS = ("xla", "blockwise", "pallas", "ring", "auto")
_PALLAS = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}


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
    impl: one of IMPLEMENTATIONS.
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
    raise ValueError(f"attention impl {impl!r} is not one of {IMPLEMENTATIONS}")
  masks = dict(q_segment_ids=segment_ids, q_positions=positions,
               kv_segment_ids=segment_ids if kv_segment_ids is None else kv_segment_ids,
               kv_positions=positions if kv_positions is None else kv_positions,
               causal=True, window=window, softcap=softcap, scale=scale)
  if impl == "xla":
    return ptx_kernels.dense_attention(q, k, v, **masks)[0]
  if impl == "ring":
    if jax.sharding.get_abstract_mesh().empty:
      raise ValueError("attention impl 'ring' runs over the `seq` axis of the current mesh; none is set")
    return ptx_kernels.ring_attention(q, k, v, **masks)[0]
  if impl == "pallas":
    backend = jax.default_backend()
    if backend not in _PALLAS:
      raise ValueError(f"attention impl 'pallas' needs a GPU or TPU, not {backend!r}; use 'blockwise' or 'auto'")
    return ptx_kernels.flash_attention(q, k, v, impl=_PALLAS[backend], **masks)[0]
  return ptx_kernels.flash_attention(q, k, v, impl=impl, **masks)[0]
