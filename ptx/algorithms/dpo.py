"""Preference optimisation: DPO, conservative DPO, IPO, hinge and SimPO.

A preference batch is `{"chosen": batch, "rejected": batch}` (one sequence
per row, the same row i of both is one pair). With h the policy's and r the
reference's summed target log-probs, and z = beta * ((h_c - h_r) - (r_c - r_r)):

  sigmoid  -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)   (eps = label_smoothing;
                                                              eps > 0 is conservative DPO)
  hinge    max(0, 1 - z)
  ipo      ((a_c - a_r) - (ra_c - ra_r) - 1 / (2 beta))^2   with a = length-averaged log-probs
  simpo    -log sigmoid(beta (a_c - a_r) - gamma)           reference-free

Reference log-probs come from `TrainState.ref_params` through `prepare`
(a frozen copy of the initial policy, in the same jitted step), or are
given in the batch as `ref_chosen_logps` / `ref_rejected_logps`.

A row without any target token is padding (the empty filler rows of a short
last batch): it is in neither the loss nor any metric mean, and `weight`
counts only the real pairs, so a padded batch gives the unpadded one's
loss, gradient and metrics.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ptx import config_rules
from ptx import sharding
from ptx.algorithms.sft import next_token_targets
from ptx.config import DPOConfig
from ptx.model_config import ModelConfig
from ptx.models import moe
from ptx.models.chunked_logits import token_stats

Batch = dict[str, Any]


def sequence_logps(params: Any, batch: Batch, model: ModelConfig,
                   rules: sharding.Rules) -> tuple[jax.Array, jax.Array, moe.LayerStats]:
  """Summed target log-probs [B], target counts [B] and the MoE statistics of a padded batch (chunked projection).

  Raises:
    ConfigError: for a model whose MoE layers can drop token copies (`config_rules.check_preference_model`).
  """
  config_rules.check_preference_model(model)
  # Preference rows hold one sequence each from column 0 (`DataConfig.rows`), which cuDNN can attend over.
  stats, trace = token_stats(params, batch["tokens"], model, positions=batch["positions"],
                             segment_ids=batch["segment_ids"], rules=rules, rows="padded_right")
  _, weights = next_token_targets(batch)
  return (stats.log_probs[:, 1:] * weights).sum(axis=-1), weights.sum(axis=-1), trace.stats


def _pair_logps(params, batch, model, rules):
  """Log-probs of chosen and rejected in one forward pass over the stacked pair, and its MoE statistics."""
  both = jax.tree.map(lambda c, r: jnp.concatenate([c, r], axis=0), batch["chosen"], batch["rejected"])
  logps, counts, moe_stats = sequence_logps(params, both, model, rules)
  n = batch["chosen"]["tokens"].shape[0]
  return logps[:n], logps[n:], counts[:n], counts[n:], moe_stats


def prepare(ref_params: Any, batch: Batch, *, model: ModelConfig,
            rules: sharding.Rules = sharding.DEFAULT_RULES) -> Batch:
  """Adds the reference policy's `ref_chosen_logps` / `ref_rejected_logps` [B] to the batch."""
  chosen, rejected, _, _, _ = _pair_logps(ref_params, batch, model, rules)
  return {**batch, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}


def preference_loss(chosen: jax.Array, rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array,
                    chosen_count: jax.Array, rejected_count: jax.Array, cfg: DPOConfig
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-pair losses [B] and implicit rewards (chosen [B], rejected [B]) for `cfg.loss_type`."""
  beta = cfg.beta
  avg_c, avg_r = chosen / jnp.maximum(chosen_count, 1), rejected / jnp.maximum(rejected_count, 1)
  if cfg.loss_type == "simpo":
    rewards = beta * avg_c, beta * avg_r
    return -jax.nn.log_sigmoid(beta * (avg_c - avg_r) - cfg.simpo_gamma), *rewards
  rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
  z = rewards[0] - rewards[1]
  if cfg.loss_type == "sigmoid":
    eps = cfg.label_smoothing
    losses = -(1 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)
  elif cfg.loss_type == "hinge":
    losses = jax.nn.relu(1 - z)
  elif cfg.loss_type == "ipo":
    ref_avg_c = ref_chosen / jnp.maximum(chosen_count, 1)
    ref_avg_r = ref_rejected / jnp.maximum(rejected_count, 1)
    losses = ((avg_c - avg_r) - (ref_avg_c - ref_avg_r) - 1 / (2 * beta)) ** 2
  else:
    raise ValueError(f"dpo.loss_type: unknown {cfg.loss_type!r}")
  return losses, *rewards


def loss(params: Any, batch: Batch, rng: jax.Array, *, model: ModelConfig, dpo: DPOConfig,
         rules: sharding.Rules = sharding.DEFAULT_RULES) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean preference loss over the pairs of `batch`, with the metrics users know from TRL.

  Args:
    params: the policy's parameters.
    batch: `chosen` and `rejected` padded batches, plus `ref_chosen_logps` and
      `ref_rejected_logps` [B] unless the loss is reference-free (simpo).
    rng: unused; part of the loss-function contract.
    model: the model config.
    dpo: the loss variant and its hyper-parameters.
    rules: sharding rules for activation constraints.

  Returns:
    (loss, metrics): `loss`, `rewards/chosen`, `rewards/rejected`,
    `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`
    (means over the real pairs), and `weight` (the number of real pairs); for
    a Mixture of Experts `moe/...` statistics, their auxiliary losses added to
    the value optimised (`model.moe_balance_coef`, `model.moe_z_coef`).
  """
  del rng
  chosen, rejected, n_chosen, n_rejected, moe_stats = _pair_logps(params, batch, model, rules)
  if dpo.loss_type == "simpo":  # reference-free
    ref_chosen = ref_rejected = jnp.zeros_like(chosen)
  elif "ref_chosen_logps" not in batch:
    raise ValueError(f"dpo loss {dpo.loss_type!r} needs ref_chosen_logps/ref_rejected_logps: pass prepare= "
                     "to the train step or precompute them into the batch")
  else:
    ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
  losses, reward_chosen, reward_rejected = preference_loss(
      chosen, rejected, ref_chosen, ref_rejected, n_chosen, n_rejected, dpo)
  real = (n_chosen + n_rejected > 0).astype(jnp.float32)  # padding rows have no target token
  pairs = real.sum()
  mean = lambda x: (x * real).sum() / jnp.maximum(pairs, 1.0)  # a batch of padding only contributes 0
  value = mean(losses)
  return value + moe.aux_loss(moe_stats, model), {
      "loss": value,
      "rewards/chosen": mean(reward_chosen),
      "rewards/rejected": mean(reward_rejected),
      "rewards/accuracies": mean((reward_chosen > reward_rejected).astype(jnp.float32)),
      "rewards/margins": mean(reward_chosen - reward_rejected),
      "logps/chosen": mean(chosen),
      "logps/rejected": mean(rejected),
      "weight": pairs,
      **moe.metrics(moe_stats),
  }
