"""Sampling rules: how the next token is drawn from the policy's logits.

Order: greedy short-circuits everything; otherwise the logits are divided by
the temperature, then truncated by top-k, then by top-p on the renormalised
top-k distribution, then by min-p (relative to the most likely token, which
renormalising does not change), and one token is drawn from what is left.
Ties at a threshold are kept. `SamplingConfig` is defined in `ptx.config`,
where `GRPOConfig.sampling` holds the rollouts' rules.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from ptx_kernels import xla_cpu_workarounds

from ptx.config import SamplingConfig
from ptx.models.decoder import tempered


def truncated_logits(logits_BV: jax.Array, config: SamplingConfig) -> jax.Array:
  """Tempered float32 logits [B, V] with -inf outside the kept set.

  Each truncation runs only when enabled in the frozen `config`: shape-static
  choices made at trace time (top-k fixes the size of `lax.top_k`).
  """
  logits = tempered(logits_BV.astype(jnp.float32), config.temperature)
  if config.top_k and config.top_k < logits.shape[-1]:
    kth_BK = jax.lax.top_k(logits, config.top_k)[0][:, -1:]
    logits = jnp.where(logits >= kth_BK, logits, -jnp.inf)
  if config.top_p < 1.0:
    probs = jax.nn.softmax(logits, axis=-1)
    sorted_BV = -jnp.sort(-probs, axis=-1)
    # A token is kept while the mass strictly before it is below top_p.
    mass_before = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV
    n_kept = jnp.sum(mass_before < config.top_p, axis=-1, keepdims=True)
    threshold_B1 = jnp.take_along_axis(sorted_BV, n_kept - 1, axis=-1)
    logits = jnp.where(probs >= threshold_B1, logits, -jnp.inf)
  if config.min_p > 0.0:
    # p / p_max = exp(logit - logit_max), so no softmax is needed.
    ratio = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    logits = jnp.where(ratio >= config.min_p, logits, -jnp.inf)
  return logits


def sample_tokens(logits_BV: jax.Array, uniforms_B: jax.Array, config: SamplingConfig) -> jax.Array:
  """Draws one int32 token per row of logits [B, V] under `config`, by inverting the CDF.

  Args:
    logits_BV: the policy's logits.
    uniforms_B: one float32 uniform in [0, 1) per row. A decode loop draws
      them all before it starts, so it runs no random-number generation per
      token (threefry is a loop of small ops on CPU).
    config: the sampling rules.

  Returns:
    int32 [B] tokens, each drawn with the probability of the truncated
    distribution (up to float32 rounding of cumulative sums).
  """
  if config.greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  return invert_cdf(probabilities(logits_BV, config), uniforms_B)


def probabilities(logits_BV: jax.Array, config: SamplingConfig) -> jax.Array:
  """The float32 distribution [B, V] that `sample_tokens` draws from: one-hot at the argmax when greedy."""
  if config.greedy:
    return jax.nn.one_hot(jnp.argmax(logits_BV, axis=-1), logits_BV.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(truncated_logits(logits_BV, config), axis=-1)


def invert_cdf(probs_BV: jax.Array, uniforms_B: jax.Array) -> jax.Array:
  """Row b's token is where its cumulative probability first reaches (1 - u_b) of the row's mass.

  Two levels, so no cumulative sum runs over the whole vocabulary: pick a
  block of ~sqrt(V) tokens by the CDF of block masses, then a token inside
  it by the block's own CDF, at the same quantile rescaled into the block.
  Zero-probability tokens (a flat step of a CDF) are never drawn, because the
  quantile is kept in (0, mass].
  """
  B, V = probs_BV.shape
  width = 1 << math.ceil(math.log2(math.sqrt(V)))
  n_blocks = -(-V // width)
  blocks_BNW = jnp.pad(probs_BV, ((0, 0), (0, n_blocks * width - V))).reshape(B, n_blocks, width)
  mass_BN = jnp.sum(blocks_BNW, axis=-1)
  cdf_BN = _cumsum(mass_BN)
  target_B1 = (1.0 - uniforms_B)[:, None] * cdf_BN[:, -1:]
  block_B1 = jnp.minimum(jnp.sum(cdf_BN < target_B1, axis=-1, keepdims=True), n_blocks - 1)
  block_mass_B1 = jnp.take_along_axis(mass_BN, block_B1, axis=-1)
  before_B1 = jnp.take_along_axis(cdf_BN, block_B1, axis=-1) - block_mass_B1
  # The quantile inside the block, in (0, 1] whatever the rounding of the sums.
  quantile_B1 = jnp.clip((target_B1 - before_B1) / block_mass_B1, jnp.finfo(jnp.float32).tiny, 1.0)
  inner_cdf_BW = _cumsum(jnp.take_along_axis(blocks_BNW, block_B1[:, :, None], axis=1)[:, 0])
  inner_B = jnp.sum(inner_cdf_BW < quantile_B1 * inner_cdf_BW[:, -1:], axis=-1)
  return (block_B1[:, 0] * width + jnp.minimum(inner_B, width - 1)).astype(jnp.int32)


def _cumsum(x_BN: jax.Array) -> jax.Array:
  """The cumulative sum along the last axis; on XLA:CPU a log-depth scan, as its cumsum is quadratic in N."""
  return xla_cpu_workarounds.platform_dependent(
      x_BN, cpu=lambda x: jax.lax.associative_scan(jnp.add, x, axis=-1), default=lambda x: jnp.cumsum(x, axis=-1))
