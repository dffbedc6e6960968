"""JAX's TPU splash attention behind ptx's layout and visibility rule, forward and backward.

Splash (`jax.experimental.pallas.ops.tpu.splash_attention`, the Mosaic kernel MaxText and Tunix train with) masks
by token index, not by position. ptx's rule (`mask.py`) maps onto it as follows:

- heads: q [B, T, H, D] and k/v [B, S, KV, D] move heads first, and splash's MHA kernel runs on each batch row
  (`jax.vmap`). Given KV < H kv heads, the kernel itself reads kv head h // (H // KV) for query head h, ptx's
  grouping, and sums a group's dK/dV in VMEM: K/V are never repeated in HBM.
- causal and window: q_pos - kv_pos < window is kv >= q - (window - 1) by index, splash's
  `LocalMask((window - 1, 0))` with causal, `LocalMask((window - 1, None))` without; causal alone is `CausalMask`,
  neither is `FullMask`.
- segments: splash's `SegmentIds` treat 0 as an ordinary segment, so padding queries attend to padding keys (never
  to real ones: the ids differ). Their outputs are zeroed here, which also zeroes their cotangents: no gradient
  leaves a padding row, and dQ, dK, dV of padding tokens are exactly 0, as the reference gives.
- soft-cap and scale: splash has no scale and caps the raw q.k (`attn_logits_soft_cap`), so q is scaled first:
  cap * tanh(scale * q.k / cap), ptx's rule.
- lengths that are not a multiple of the tiles are padded with segment id 0 and cropped back.
- values may be narrower or wider than keys (Dv != D): splash's kernels carry the value width apart.

Precondition, which holds for every training and prefill layout of ptx but cannot be checked on traced ids:
self-attention over one sequence (q_len == kv_len, checked; q_segment_ids and kv_segment_ids the same ids), each
segment one contiguous run of tokens whose positions advance by one per token. Then index distances equal
position distances wherever the segments agree, and every non-padding query sees at least itself.

What splash does not give: the lse with a gradient (splash returns it only from a forward without a VJP), so ring
hops, which merge partial results through the lse, stay on ptx's kernels; attention sinks too (ptx applies them to
(out, lse) with `with_sinks`; splash in jax 0.10.2 takes sinks of its own, not wired here). A window must be a
Python int, since splash builds its mask on the host.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from ptx_kernels import blockwise
from ptx_kernels import mask as mask_lib
from ptx_kernels.block_sizes import BlockSizes

# Splash's tiles hold whole (8, 128) vregs: block_q and block_kv are multiples of the 128 lanes.
_MIN_TILE = 128


def splash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids=None, kv_segment_ids=None,
    causal: bool = True, window: int | None = None, softcap: float | None = None, scale: float | None = None,
    block_sizes: BlockSizes | None = None, interpret: bool = False,
) -> jax.Array:
  """Self-attention through JAX's splash kernel, differentiable in q, k and v (precondition: module docstring).

  Args:
    q: queries [B, T, H, D]; H must be a multiple of the kv heads (GQA/MQA).
    k: keys [B, T, KV, D] (self-attention: as long as q).
    v: values [B, T, KV, Dv].
    q_segment_ids: int [B, T] packing ids, 0 = padding; default all ones.
    kv_segment_ids: int [B, T], the same ids as q_segment_ids, given together with them.
    causal: mask later keys.
    window: mask keys with q_position - kv_position >= window; a Python int or None.
    softcap: if set, logits become softcap * tanh(logits / softcap).
    scale: logit scale, default D ** -0.5.
    block_sizes: tiles of the forward and both backward kernels; default BlockSizes(). Clamped to the sequence
      and raised to at least 128.
    interpret: run the kernels through the generic Pallas interpreter (on CPU), as JAX's own splash tests do. Not
      the TPU interpreter (`pltpu.InterpretParams`, which ptx's own Mosaic kernels use): in jax 0.10.2 it fails on
      a vmapped splash kernel (it zips the batched grid with the unbatched dimension semantics).

  Returns:
    out [B, T, H, Dv] in q.dtype; padding queries give 0. No lse (module docstring).

  Raises:
    ValueError: for shapes that disagree, q and k of different lengths, a window that is not a positive Python int,
      or a backend other than TPU without interpret.
  """
  mask_lib.check_qkv(q, k, v)
  b, t, h, d = q.shape
  if k.shape[1] != t:
    raise ValueError(f"splash attention is self-attention: q and k must be equally long, got q {q.shape}, k {k.shape}")
  if not interpret and jax.default_backend() != "tpu":
    raise ValueError(f"splash attention runs on a TPU, not on {jax.default_backend()!r}: pass interpret=True for the "
                     "Pallas interpreter")
  if window is not None and not (isinstance(window, int) and window >= 1):
    raise ValueError(f"splash attention builds its mask on the host: window must be a Python int >= 1 or None, "
                     f"got {window!r}")
  mi = mask_lib.make_mask_inputs(b, t, t, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  tiles = (block_sizes or BlockSizes()).clamp(t, t, minimum=_MIN_TILE)
  pad = lambda x: blockwise.pad_to_tiles(x, max(tiles.block_q, tiles.block_kv))
  heads_first = lambda x: pad(x).transpose(0, 2, 1, 3)  # [B, heads, T', width]
  scale = d ** -0.5 if scale is None else scale
  segments = splash.SegmentIds(pad(mi.q_segment_ids), pad(mi.kv_segment_ids))
  kernel = _kernel(segments.q.shape[1], h, causal, window, None if softcap is None else float(softcap), tiles,
                   interpret)
  # Scaled before the kernel, which soft-caps the product it is given (module docstring).
  out = jax.vmap(kernel)(heads_first((q * scale).astype(q.dtype)), heads_first(k), heads_first(v), segments)
  out = out.transpose(0, 2, 1, 3)[:, :t]
  return jnp.where(mi.q_segment_ids[:, :, None, None] != 0, out, 0).astype(q.dtype)


def _kernel(length: int, heads: int, causal: bool, window: int | None, softcap: float | None, tiles: BlockSizes,
            interpret: bool):
  """Splash's kernel for one batch row (splash caches the host numpy work of its block tables per mask)."""
  shape = (length, length)
  if window is not None:
    mask = splash.LocalMask(shape, (window - 1, 0 if causal else None), offset=0)
  else:
    mask = splash.CausalMask(shape) if causal else splash.FullMask(shape)
  bq, bk = tiles.block_q, tiles.block_kv
  sizes = splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                            block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
  return splash.make_splash_mha(
      splash.MultiHeadMask([mask] * heads), block_sizes=sizes, attn_logits_soft_cap=softcap, head_shards=1,
      q_seq_shards=1, interpret=interpret)
