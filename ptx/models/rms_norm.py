"""RMSNorm, the normalisation of every ptx decoder layer, computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ptx.model_config import ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, cfg: ModelConfig) -> jax.Array:
  """RMSNorm over the last axis, computed in float32; Gemma scales by (1 + w)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.norm_eps)
  scale = weight.astype(jnp.float32) + (1.0 if cfg.norm_plus_one else 0.0)
  return (normed * scale.reshape((1,) * (x.ndim - 1) + scale.shape)).astype(x.dtype)
