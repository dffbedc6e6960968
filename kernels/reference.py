"""Naive softmax attention: the numerical reference every kernel is tested against.

It materialises the full [B, KV, G, T, S] logits (quadratic memory), computes in
float32 (float64 when given float64 under x64) and is differentiable by plain
autodiff with finite gradients on rows that see no key.
"""

import jax
import jax.numpy as jnp

from ptx_kernels import mask as mask_lib


def reference_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids=None,
    kv_segment_ids=None, q_positions=None, kv_positions=None,
    causal: bool = True, window=None, softcap: float | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Softmax attention with the full logits matrix.

  Args:
    q: queries [B, T, H, D]; H must be a multiple of the kv heads.
    k: keys [B, S, KV, D].
    v: values [B, S, KV, Dv].
    q_segment_ids: int [B, T] packing ids, 0 = padding; default all ones.
    kv_segment_ids: int [B, S], given together with q_segment_ids.
    q_positions: int [B, T] token positions; default arange(T).
    kv_positions: int [B, S], given together with q_positions.
    causal: mask keys with kv_position > q_position.
    window: mask keys with q_position - kv_position >= window (int, int32
      scalar or None).
    softcap: if set, logits become softcap * tanh(logits / softcap).
    scale: logit scale, default D ** -0.5.

  Returns:
    (out [B, T, H, Dv] in q.dtype, lse [B, H, T] natural-log in the compute
    dtype); rows with no visible key give out 0 and lse -inf.
  """
  mask_lib.check_qkv(q, k, v)
  b, t, h, d = q.shape
  s, kv = k.shape[1], k.shape[2]
  mi = mask_lib.make_mask_inputs(
      b, t, s, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_positions=q_positions, kv_positions=kv_positions, window=window)
  dtype = jnp.promote_types(q.dtype, jnp.float32)
  scale = d ** -0.5 if scale is None else scale
  q5 = q.reshape(b, t, kv, h // kv, d).astype(dtype)
  logits = jnp.einsum("btkgd,bskd->bkgts", q5, k.astype(dtype),
                      precision=jax.lax.Precision.HIGHEST) * scale
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  ok = mask_lib.visible(*mi[:4], causal=causal, window=mi.window)[:, None, None]
  m = jnp.max(jnp.where(ok, logits, -jnp.inf), axis=-1, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  # Masking inside the exp (not after it) keeps the gradient of masked
  # entries exactly zero instead of 0 * inf.
  p = jnp.exp(jnp.where(ok, logits - m, -jnp.inf))
  total = jnp.sum(p, axis=-1)
  safe = jnp.where(total > 0, total, 1.0)
  out = jnp.einsum("bkgts,bskd->btkgd", p / safe[..., None], v.astype(dtype),
                   precision=jax.lax.Precision.HIGHEST)
  lse = jnp.where(total > 0, m[..., 0] + jnp.log(safe), -jnp.inf)
  return out.reshape(b, t, h, -1).astype(q.dtype), lse.reshape(b, h, t)
