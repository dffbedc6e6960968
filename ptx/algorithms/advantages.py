"""Outcome-reward shaping for the GRPO family: advantages, overlong punishment, group filters.

Rewards are float32 [N] with N = B prompts x G samples laid out group-major
(sequence i belongs to group i // G). NaN marks an unscorable sample: it is
left out of every group statistic and gets advantage 0 (its tokens are
masked by the caller). A reward may come as named components {name: [N]}
(sorted by name wherever weights align with them). Formulas and test
vectors: docs/grpo-loss.md sections 5.2, 5.7 and 5.8.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

ESTIMATORS = ("grpo", "grpo_no_std", "grpo_batch_std", "rloo", "reinforce_pp_baseline")
# Any reward: one float32 [N] array, or named components {name: [N]}.
Rewards = Any


def _group_stats(rewards_BG: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-group mean, unbiased std and valid count over the non-NaN rewards, each [B, 1]."""
  valid = ~jnp.isnan(rewards_BG)
  r = jnp.where(valid, rewards_BG, 0.0)
  count = valid.sum(axis=1, keepdims=True).astype(jnp.float32)
  mean = r.sum(axis=1, keepdims=True) / jnp.maximum(count, 1.0)
  var = (jnp.where(valid, r - mean, 0.0) ** 2).sum(axis=1, keepdims=True) / jnp.maximum(count - 1.0, 1.0)
  return mean, jnp.sqrt(var), count


def advantages(rewards: jax.Array, group_size: int, estimator: str, *, eps: float = 1e-6,
               lengths: jax.Array | None = None) -> jax.Array:
  """Per-sequence advantages A [N] from outcome rewards [N].

  Args:
    rewards: float32 [N], group-major; NaN for unscorable samples.
    group_size: G; N must be a multiple of it. G = 1 gives A = R.
    estimator: one of ESTIMATORS.
    eps: added to the standard deviation of std-normalised estimators.
    lengths: response tokens per sequence [N]; `reinforce_pp_baseline` whitens
      over tokens, so it needs them.

  Returns:
    float32 [N]; exactly 0 for zero-variance groups and for NaN rewards.
  """
  if estimator not in ESTIMATORS:
    raise ValueError(f"grpo.advantage: unknown estimator {estimator!r}; known: {ESTIMATORS}")
  n = rewards.shape[0]
  if n % group_size:
    raise ValueError(f"{n} rewards do not split into groups of {group_size}")
  valid = ~jnp.isnan(rewards)
  if group_size == 1:  # no group baseline (verl: mu = 0, sigma = 1)
    return jnp.where(valid, rewards, 0.0)
  rewards_BG = rewards.reshape(n // group_size, group_size)
  mean, std, count = _group_stats(rewards_BG)
  centred = rewards_BG - mean
  if estimator == "grpo":
    adv = centred / (std + eps)
  elif estimator == "grpo_no_std":
    adv = centred
  elif estimator == "grpo_batch_std":
    _, batch_std, _ = _group_stats(rewards[None])
    adv = centred / (batch_std + eps)
  elif estimator == "rloo":
    # R_i minus the mean of the other valid samples of its group.
    adv = centred * count / jnp.maximum(count - 1.0, 1.0)
  else:  # reinforce_pp_baseline: group-mean baseline, then whitened over all valid tokens
    if lengths is None:
      raise ValueError("advantage 'reinforce_pp_baseline' whitens over tokens and needs lengths")
    flat = centred.reshape(n)
    tokens = jnp.where(valid, lengths, 0).astype(jnp.float32)
    total = jnp.maximum(tokens.sum(), 1.0)
    mu = jnp.where(valid, flat, 0.0) @ tokens / total
    var = (jnp.where(valid, flat - mu, 0.0) ** 2) @ tokens / jnp.maximum(total - 1.0, 1.0)
    adv = ((flat - mu) / (jnp.sqrt(var) + eps)).reshape(rewards_BG.shape)
  return jnp.where(valid, adv.reshape(n), 0.0)


def component_weights(rewards: Rewards, weights: Sequence[float]) -> tuple[float, ...]:
  """The weight of each reward component in sorted-name order (all 1 when `weights` is empty)."""
  if not isinstance(rewards, dict):
    if weights:
      raise ValueError(f"grpo.reward_weights={tuple(weights)} is set but the reward has no named components")
    return (1.0,)
  names = sorted(rewards)
  if weights and len(weights) != len(names):
    raise ValueError(f"grpo.reward_weights: {len(weights)} weights for the reward components {names} "
                     "(one per component, in sorted-name order)")
  return tuple(float(w) for w in weights) if weights else (1.0,) * len(names)


def components(rewards: Rewards) -> jax.Array:
  """The reward components as one array [K, N] in sorted-name order ([1, N] for a single reward)."""
  if not isinstance(rewards, dict):
    return jnp.asarray(rewards)[None]
  return jnp.stack([jnp.asarray(rewards[k]) for k in sorted(rewards)])


def total_reward(rewards: Rewards, weights: Sequence[float] = ()) -> Any:
  """The scalar reward R [N]: the reward itself, or the weighted sum of its components (NaN if any is NaN)."""
  if not isinstance(rewards, dict):
    component_weights(rewards, weights)  # rejects weights without components
    return rewards
  w = component_weights(rewards, weights)
  return sum(wk * rewards[k] for wk, k in zip(w, sorted(rewards)))


def normalize_then_sum(components_KN: jax.Array, weights: Sequence[float], group_size: int, *,
                       eps: float = 1e-6) -> jax.Array:
  """GDPO advantages A [N]: each component group-normalised, their weighted sum, then normalised over the batch.

  Args:
    components_KN: float32 [K, N] reward components, group-major; a sample
      with a NaN in any component is unscorable.
    weights: K component weights.
    group_size: G.
    eps: added to every standard deviation.

  Returns:
    float32 [N]; 0 for unscorable samples.
  """
  valid = ~jnp.isnan(components_KN).any(axis=0)
  scored_KN = jnp.where(valid, components_KN, jnp.nan)  # unscorable in one component: out of every statistic
  per_KN = jax.vmap(lambda r: advantages(r, group_size, "grpo", eps=eps))(scored_KN)
  combined = jnp.asarray(weights, jnp.float32) @ per_KN
  mean, std, _ = _group_stats(jnp.where(valid, combined, jnp.nan)[None])
  return jnp.where(valid, (combined - mean[0]) / (std[0] + eps), 0.0)


def overlong_punishment(lengths: jax.Array, max_tokens: int, buffer: int) -> jax.Array:
  """DAPO's soft overlong punishment R_len(L) in [-1, 0] per sequence (0 when buffer is 0)."""
  if buffer <= 0:
    return jnp.zeros(lengths.shape, jnp.float32)
  lengths = lengths.astype(jnp.float32)
  soft = ((max_tokens - buffer) - lengths) / buffer
  return jnp.where(lengths <= max_tokens - buffer, 0.0, jnp.where(lengths <= max_tokens, soft, -1.0))


def groups_with_signal(metric: jax.Array, group_size: int) -> jax.Array:
  """DAPO dynamic sampling: True [B] for groups whose metric (e.g. accuracy) is not constant."""
  metric_BG = metric.reshape(-1, group_size)
  return jnp.any(metric_BG != metric_BG[:, :1], axis=1)
