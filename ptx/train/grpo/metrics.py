"""GRPO's rollout metrics (docs/grpo-loss.md section 5.10 names): rewards, lengths, groups, staleness, and the
sampler's log-prob gap to the policy (int8 rollouts, `ptx.models.rollout_params`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ptx.algorithms import advantages as adv_lib
from ptx.sampling.generation import LENGTH, Generation


def rollout_metrics(rewards: adv_lib.Rewards, total: jax.Array, gen: Generation, G: int) -> dict[str, jax.Array]:
  """Reward and length metrics of R = B x G rollouts, and `reward/{component}/mean` for named components."""
  lengths = gen.lengths.astype(jnp.float32)
  scored_mean = lambda x: jnp.where(jnp.isnan(x), 0.0, x).sum() / jnp.maximum((~jnp.isnan(x)).sum(), 1)
  components = {f"reward/{k}/mean": scored_mean(v) for k, v in rewards.items()} if isinstance(rewards, dict) else {}
  scored = ~jnp.isnan(total)
  r = jnp.where(scored, total, 0.0)
  n_scored = jnp.maximum(scored.sum(), 1)
  mean = scored_mean(total)
  return {
      **components,
      "reward/mean": mean,
      "reward/std": jnp.sqrt((jnp.where(scored, r - mean, 0.0) ** 2).sum() / n_scored),
      "reward/unscored_frac": 1.0 - scored.mean(),
      "frac_reward_zero_std": jnp.mean(~adv_lib.groups_with_signal(total, G)) if G > 1 else jnp.float32(1.0),
      "response_length/mean": lengths.mean(),
      "response_length/max": lengths.max(),
      "response_length/min": lengths.min(),
      "response_length/clip_ratio": jnp.mean(gen.finish_reasons == LENGTH),
      "rollout/pass_rate_groups": jnp.mean(jnp.any(r.reshape(-1, G) > 0, axis=1)),
  }


def staleness_metrics(mask: jax.Array, trainer_logps: jax.Array, sampler_logps: jax.Array) -> dict[str, jax.Array]:
  """Stale rollouts: the behaviour-to-current mismatch and importance ratios over the response tokens."""
  diff = (sampler_logps - trainer_logps) * mask
  is_ratio = jnp.exp(jnp.clip(trainer_logps - sampler_logps, -20.0, 20.0))
  tokens = jnp.maximum(mask.sum(), 1.0)
  return {
      "rollout/logp_mismatch_kl": diff.sum() / tokens,
      "rollout/is_ratio/mean": (is_ratio * mask).sum() / tokens,
      "rollout/is_ratio/max": jnp.max(jnp.where(mask > 0, is_ratio, 0.0)),
      "rollout/is_ratio/min": jnp.min(jnp.where(mask > 0, is_ratio, jnp.float32(1e30))),
  }


def logprob_gap(mask: jax.Array, policy_logps: jax.Array, rollout_logps: jax.Array) -> dict[str, jax.Array]:
  """Mean |rollout - policy| log-prob over response tokens, beside `staleness_metrics` (its importance ratios).

  Args:
    mask: {0, 1} [N, S], 1 on the response tokens.
    policy_logps: the policy's recomputed log-probs [N, S] (the loss's old log-probs).
    rollout_logps: the sampler's log-probs [N, S].

  Returns:
    `rollout/logp_gap_abs` and `staleness_metrics`' `rollout/logp_mismatch_kl` and
    `rollout/is_ratio/{mean,max,min}` (ratio = policy / rollout probability, the truncated
    importance weight before its cap).
  """
  mask = mask.astype(jnp.float32)
  gap = (jnp.abs(rollout_logps - policy_logps) * mask).sum() / jnp.maximum(mask.sum(), 1.0)
  return {"rollout/logp_gap_abs": gap, **staleness_metrics(mask, policy_logps, rollout_logps)}
