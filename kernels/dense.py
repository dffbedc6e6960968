"""Materialised softmax attention for short sequences: the fast XLA path.

Same mask rule and signature as `reference_attention`, but built for speed
rather than as a numerical yardstick: matmuls run in the input dtype with
float32 logits, masked logits are replaced by a large finite negative, and
rows that see no key are zeroed after the fact.

The backward is written out (`jax.custom_vjp`) instead of differentiated
through the softmax: it keeps only the probabilities and the output, and
computes dS = P * (dP - rowsum(dO * O) + dlse) in one fused pass, where
autodiff keeps the masked logits and the softmax's intermediates and walks
them back op by op: fewer [T, S] arrays written and read on any backend.
"""

import functools

import jax
import jax.numpy as jnp

from ptx_kernels import mask as mask_lib

# Finite, so a row without any visible key never computes inf - inf.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


@jax.named_scope("ptx_dense_attention")  # Marks its ops in profiles and compiled programs.
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
  out5, lse = _attend(q5, k, v, ok, scale, softcap)
  return out5.reshape(b, t, h, -1), lse.reshape(b, h, t)


def _forward(q5, k, v, ok, scale, softcap):
  """(out [B, T, KV, G, Dv], lse [B, KV, G, T], residuals) of one masked softmax attention.

  Heads move in front of tokens once ([B, KV, G*T, D]), so every matmul
  here and in the backward has its batch axes leading, and a KV head's
  grouped queries form one [G*T, D] matrix.
  """
  b, t, kv, g, d = q5.shape
  # [B, KV, G*T, D]: a group's queries form one matrix against their KV head's keys.
  q_h = q5.transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)
  k_h, v_h = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, KV, S, D]
  logits = jnp.einsum("bkmd,bksd->bkms", q_h, k_h, preferred_element_type=jnp.float32) * scale
  capped = None
  if softcap is not None:
    capped = jnp.tanh(logits / softcap)
    logits = softcap * capped
  s = logits.shape[-1]
  logits = jnp.where(ok[:, None, None], logits.reshape(b, kv, g, t, s), _MASKED).reshape(b, kv, g * t, s)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  exp = jnp.exp(logits - row_max)
  row_sum = jnp.sum(exp, axis=-1, keepdims=True)
  probs = exp / row_sum  # [B, KV, G*T, S]; uniform over a row that sees no key
  seen = jnp.tile(jnp.any(ok, axis=-1), (1, g))[:, None, :]  # [B, 1, G*T]
  out_h = jnp.einsum("bkms,bksd->bkmd", probs.astype(v.dtype), v_h, preferred_element_type=jnp.float32)
  out_h = jnp.where(seen[..., None], out_h, 0.0)
  lse = jnp.where(seen, (row_max + jnp.log(row_sum))[..., 0], -jnp.inf).reshape(b, kv, g, t)
  out = out_h.reshape(b, kv, g, t, -1).transpose(0, 3, 1, 2, 4).astype(q5.dtype)
  return out, lse, (q_h, k_h, v_h, probs, out_h, seen, capped)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(q5, k, v, ok, scale, softcap):
  """Attention over grouped queries q5 [B, T, KV, G, D]; `ok` [B, T, S] is the visibility."""
  return _forward(q5, k, v, ok, scale, softcap)[:2]


def _attend_fwd(q5, k, v, ok, scale, softcap):
  """The primal outputs and what the backward needs: P, O and the soft-cap's tanh."""
  out, lse, residuals = _forward(q5, k, v, ok, scale, softcap)
  return (out, lse), residuals


def _attend_bwd(scale, softcap, residuals, cotangents):
  """dQ, dK, dV from dS = P * (dP - rowsum(dO * O) + dlse), the softmax's VJP in one expression."""
  q_h, k_h, v_h, probs, out_h, seen, capped = residuals
  d_out, d_lse = cotangents
  # A row that sees no key is constant (out 0, lse -inf): nothing flows back through it.
  b, t, kv, g, dv = d_out.shape
  d_out_h = d_out.transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, dv)
  d_out_h = jnp.where(seen[..., None], d_out_h, 0).astype(jnp.float32)
  d_lse = jnp.where(seen, d_lse.reshape(b, kv, g * t), 0.0)
  dtype = v_h.dtype
  d_v = jnp.einsum("bkms,bkmd->bksd", probs.astype(dtype), d_out_h.astype(dtype),
                   preferred_element_type=jnp.float32)
  d_probs = jnp.einsum("bkmd,bksd->bkms", d_out_h.astype(dtype), v_h, preferred_element_type=jnp.float32)
  # Every per-row term is folded into one [B, KV, M, 1] delta and the scale
  # goes on the [.., D] results, so the [B, KV, M, S] arrays take one
  # subtraction and one product (XLA:CPU's dot fusions would also
  # materialise a broadcast [B, KV, M, S] operand).
  delta = jnp.sum(d_out_h * out_h, axis=-1, keepdims=True) - d_lse[..., None]
  d_logits = probs * (d_probs - delta)
  if capped is not None:
    d_logits = d_logits * (1.0 - capped * capped)
  d_logits = d_logits.astype(q_h.dtype)
  d_q = jnp.einsum("bkms,bksd->bkmd", d_logits, k_h, preferred_element_type=jnp.float32) * scale
  d_k = jnp.einsum("bkms,bkmd->bksd", d_logits, q_h, preferred_element_type=jnp.float32) * scale
  d_q = d_q.reshape(b, kv, g, t, -1).transpose(0, 3, 1, 2, 4)
  return (d_q.astype(q_h.dtype), d_k.transpose(0, 2, 1, 3).astype(k_h.dtype),
          d_v.transpose(0, 2, 1, 3).astype(dtype), None)


_attend.defvjp(_attend_fwd, _attend_bwd)
