"""The per-step log-prob gap of the rollouts' sampler to the policy (int8 rollouts, `ptx.models.rollout_params`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ptx.train.rl_metrics import staleness_metrics


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
