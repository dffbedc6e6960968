"""`flash_attention`: the one entry point that validates inputs and picks a kernel."""

import jax

from ptx_kernels import blockwise
from ptx_kernels import implementation
from ptx_kernels import mask as mask_lib
from ptx_kernels.block_sizes import BlockSizes


def flash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids=None,
    kv_segment_ids=None, q_positions=None, kv_positions=None,
    causal: bool = True, window=None, softcap: float | None = None,
    scale: float | None = None, impl: str = "blockwise",
    block_sizes: BlockSizes | None = None, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Memory-efficient softmax attention, differentiable in q, k and v.

  Args:
    q: queries [B, T, H, D]; H must be a multiple of the kv heads (GQA/MQA).
    k: keys [B, S, KV, D].
    v: values [B, S, KV, Dv].
    q_segment_ids: int [B, T] packing ids, 0 = padding; default all ones.
    kv_segment_ids: int [B, S], given together with q_segment_ids.
    q_positions: int [B, T] global token positions; default arange(T).
    kv_positions: int [B, S], given together with q_positions.
    causal: mask keys with kv_position > q_position.
    window: mask keys with q_position - kv_position >= window. A Python int,
      None, or a traced int32 scalar (a per-layer window inside a scan; pass a
      value >= the sequence length for a global layer).
    softcap: if set, logits become softcap * tanh(logits / softcap).
    scale: logit scale, default D ** -0.5.
    impl: "blockwise" (pure JAX, any backend), "pallas_gpu" (Triton
      kernels; head_dim a power of two >= 16) or "pallas_tpu" (Mosaic
      kernels; tiles >= 128); "auto" picks the Pallas kernel of the default
      backend (TPU or GPU) and "blockwise" elsewhere
      (`implementation.choose`).
    block_sizes: tile sizes; default BlockSizes().
    interpret: run the Pallas kernels on CPU: the generic interpreter for
      "pallas_gpu", the TPU interpreter (`pltpu.InterpretParams`) for
      "pallas_tpu".

  Returns:
    (out [B, T, H, Dv] in q.dtype, lse [B, H, T] float32 natural-log
    log-sum-exp of the scaled logits). Rows with no visible key give out 0 and
    lse -inf, and finite (zero) gradients.
  """
  kernel = implementation.choose(impl, interpret)
  mask_lib.check_qkv(q, k, v)
  kernel.check(q, v)
  b, t, _, d = q.shape
  s = k.shape[1]
  mi = mask_lib.make_mask_inputs(
      b, t, s, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_positions=q_positions, kv_positions=kv_positions, window=window)
  st = kernel.static(block_sizes, t, s, d, q.dtype, causal=causal,
                     softcap=softcap, scale=scale)
  bq, bk = st.block_q, st.block_kv
  pq = lambda x: blockwise.pad_to_tiles(x, bq)
  pk = lambda x: blockwise.pad_to_tiles(x, bk)
  # Padding carries segment id 0, so padded rows and keys are never visible.
  mi = mask_lib.MaskInputs(pq(mi.q_segment_ids), pk(mi.kv_segment_ids),
                           pq(mi.q_positions), pk(mi.kv_positions), mi.window)
  out, lse = kernel.attention(pq(q), pk(k), pk(v), mi, st)
  return out[:, :t], lse[:, :, :t]
