"""Rotary position embeddings (HF `rotate_half` layout) and their scaling.

Frequencies and angles are computed in float32 from integer positions, so
packed sequences, KV caches and ring layouts only have to pass positions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ptx.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling()) -> jax.Array:
  """Returns the [head_dim // 2] float32 inverse frequencies, scaled as configured."""
  exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  inv_freq = 1.0 / (theta**exponents)
  if scaling.kind == "none":
    return inv_freq
  if scaling.kind == "linear":
    return inv_freq / scaling.factor
  if scaling.kind == "llama3":
    return _llama3_scaling(inv_freq, scaling)
  if scaling.kind == "yarn":
    return _yarn_scaling(inv_freq, head_dim, theta, scaling)
  raise ValueError(f"model.rope_scaling.kind: unknown {scaling.kind!r}")


def attention_factor(scaling: RopeScaling) -> float:
  """The factor on cos and sin (YaRN's attention temperature; 1 for other kinds)."""
  if scaling.kind != "yarn":
    return 1.0
  if scaling.attention_factor is not None:
    return scaling.attention_factor
  if scaling.mscale and scaling.mscale_all_dim:
    return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
  return yarn_mscale(scaling.factor)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
  """YaRN's temperature 0.1 m ln(factor) + 1 of a context extended `factor` times (1 when not extended)."""
  return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn_scaling(inv_freq: jax.Array, head_dim: int, theta: float, s: RopeScaling) -> jax.Array:
  """YaRN: divide low frequencies by factor, keep high ones, ramp linearly between (HF `yarn`)."""

  def dimension(rotations: float) -> float:
    # The dimension whose wavelength fits `rotations` times in the original context.
    return head_dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = dimension(s.beta_fast), dimension(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001  # as HF: avoids a zero-width ramp
  ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
  return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)


def _llama3_scaling(inv_freq: jax.Array, s: RopeScaling) -> jax.Array:
  """Llama 3.1: keep high frequencies, divide low ones by factor, blend between."""
  low_freq_wavelen = s.original_max_positions / s.low_freq_factor
  high_freq_wavelen = s.original_max_positions / s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  blended = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return jnp.where(medium, blended, scaled)


def rope_angles(positions_BT: jax.Array, inv_freq: jax.Array, factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Returns (sin, cos) times `factor` (`attention_factor`), each float32 [B, T, head_dim // 2]."""
  angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
  if factor == 1.0:
    return jnp.sin(angles), jnp.cos(angles)
  return factor * jnp.sin(angles), factor * jnp.cos(angles)


def apply_rope(x_BTNK: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """Rotates the two halves of each head (HF `rotate_half` convention)."""
  x1, x2 = jnp.split(x_BTNK.astype(jnp.float32), 2, axis=-1)
  sin, cos = sin[:, :, None, :], cos[:, :, None, :]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_BTNK.dtype)
