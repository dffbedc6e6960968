"""`cudnn_attention`: cuDNN's flash attention (through `jax.nn.dot_product_attention`) under ptx's mask rule.

cuDNN masks by causality, by a length per row and by a fixed left window,
all by token index: it computes ptx's rule (`mask.py`) exactly for rows that
hold one sequence from column 0 followed by padding, with positions 0, 1, ...
(unpacked SFT rows, DPO's rows). Packed segments, left padding, soft-caps,
traced windows and attention sinks are outside what it can say; the caller
routes those to ptx's kernels (`ptx.models.attention_choice`). It returns no
lse with a gradient, so neither a ring hop nor sinks can use it.

On the CPU (no cuDNN) tests run the same call with `implementation="xla"`,
JAX's reference of the same arguments, against `reference_attention`.
"""

import jax
import jax.numpy as jnp
import numpy as np


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, lengths: jax.Array, window: int | None = None,
                    scale: float | None = None, implementation: str = "cudnn") -> jax.Array:
  """Causal attention over right-padded rows, differentiable in q, k and v.

  Args:
    q: queries [B, T, H, D] in bf16 or fp16 (cuDNN's dtypes); H a multiple of the kv heads.
    k: keys [B, T, KV, D].
    v: values [B, T, KV, D] (as wide as the keys: cuDNN's rule).
    lengths: int32 [B] tokens of each row; columns from `lengths[b]` on are padding.
    window: a Python or numpy int: query t sees keys t - window < s <= t (ptx's rule); None: all the past.
    scale: logit scale, default D ** -0.5.
    implementation: "cudnn", or "xla" for JAX's own computation of the same call (CPU tests).

  Returns:
    out [B, T, H, D] in q's dtype; a padding query's row is 0.

  Raises:
    ValueError: when queries and keys differ in length or values in width, or the window is traced.
  """
  if q.shape[1] != k.shape[1] or v.shape != k.shape:
    raise ValueError(f"cudnn_attention runs self-attention with values as wide as keys: q {q.shape}, k {k.shape}, "
                     f"v {v.shape}")
  if window is not None and not isinstance(window, (int, np.integer)):
    raise ValueError(f"cudnn_attention takes a window fixed at compile time (a Python int), got {window!r}")
  lengths = lengths.astype(jnp.int32)
  out = jax.nn.dot_product_attention(
      q, k, v, scale=scale, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
      local_window_size=None if window is None else (int(window) - 1, 0), implementation=implementation)
  # ptx's rule gives a padding query zeros and zero gradients; cuDNN does not promise that row (JAX's "xla" zeroes it).
  is_token = jnp.arange(q.shape[1])[None, :] < lengths[:, None]
  return jnp.where(is_token[:, :, None, None], out, 0).astype(q.dtype)
