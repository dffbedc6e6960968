"""The GRPO policy loss family: PPO-clip (DAPO clip-higher, dual-clip), GSPO, CISPO.

Implements docs/grpo-loss.md sections 5.3 to 5.6. A batch holds N
sequences [N, S] (`tokens`, `positions`, `segment_ids`, and `loss_mask` = 1
on policy-generated tokens only) and, aligned with tokens (index t holds
the log-prob of token t; index 0 is unused; all of them, and the entropy,
are the policy's at the rollouts' temperature `grpo.sampling.temperature`):
  old_logps     behaviour-policy log-probs [N, S]
  ref_logps     reference log-probs [N, S] (KL in the loss only)
  sampler_logps the sampler's log-probs [N, S] (truncated IS only)
  advantages    [N] (ptx.algorithms.advantages)
  agg_weights   [N, S] per-token weights from `aggregation_weights`, computed
                once over the whole optimizer mini-batch, so the loss and its
                gradient do not depend on the micro-batch split
  agg_total     [N], every entry sum(agg_weights) over the whole mini-batch
  entropy_coef  [N], optional: every entry the adaptive c_H of this update
                (`adaptive_entropy_coef`), which then replaces the config's.
The mini-batch loss is sum(w * (rho + beta * k - c_H * H)) over its tokens.
A micro-batch returns agg_total * (its weighted mean) with `weight` = its
sum(w); gradient accumulation, which averages micro-batches by `weight`,
then reproduces the whole-batch loss and gradient exactly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ptx import sharding
from ptx.config import GRPOConfig
from ptx.model_config import ModelConfig
from ptx.models import moe
from ptx.models.shared_prefix import rollout_stats

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
                "prompt_mean", "token_sum")


def aggregation_weights(loss_mask: jax.Array, mode: str, *, group_size: int, max_tokens: int) -> jax.Array:
  """Per-token weights w [N, S] with loss = sum(w * rho), normalisers taken over the whole batch.

  Args:
    loss_mask: {0, 1} [N, S] over the whole optimizer mini-batch.
    mode: one of AGGREGATIONS (spec section 5.4).
    group_size: G, for `prompt_mean`.
    max_tokens: the constant C of `seq_mean_token_sum_norm` (max response tokens).
  """
  if mode not in AGGREGATIONS:
    raise ValueError(f"grpo.loss_agg_mode: unknown {mode!r}; known: {AGGREGATIONS}")
  m = loss_mask.astype(jnp.float32)
  lengths = m.sum(axis=1, keepdims=True)  # L_i
  n_seqs = jnp.maximum((lengths > 0).sum(), 1)  # N_M: sequences with at least one token
  if mode == "token_mean":
    return m / jnp.maximum(m.sum(), 1.0)
  if mode == "seq_mean_token_mean":
    return m / (jnp.maximum(lengths, 1.0) * n_seqs)
  if mode == "seq_mean_token_sum":
    return m / n_seqs
  if mode == "seq_mean_token_sum_norm":
    return m / (n_seqs * max_tokens)
  if mode == "token_sum":
    return m
  group_tokens = lengths.reshape(-1, group_size).sum(axis=1)  # prompt_mean
  per_seq = jnp.repeat(1.0 / jnp.maximum(group_tokens, 1.0), group_size)[:, None]
  return m * per_seq / (loss_mask.shape[0] // group_size)


def aggregation_inputs(loss_mask: jax.Array, cfg: GRPOConfig) -> dict[str, jax.Array]:
  """`agg_weights` and `agg_total` for a whole optimizer mini-batch (before any micro-batch split)."""
  w = aggregation_weights(loss_mask, cfg.loss_agg_mode, group_size=cfg.group_size,
                          max_tokens=cfg.max_response_tokens)
  return {"agg_weights": w, "agg_total": jnp.full(loss_mask.shape[:1], w.sum())}


def kl_estimate(logps: jax.Array, ref_logps: jax.Array, estimator: str) -> jax.Array:
  """Per-token KL estimate k1, k2, k3 or k3+ of the policy from the reference."""
  delta = jnp.clip(logps - ref_logps, -20.0, 20.0)
  if estimator == "k1":
    return delta
  if estimator == "k2":
    return 0.5 * delta**2
  if estimator == "k3":
    return jnp.clip(jnp.exp(-delta) + delta - 1.0, -10.0, 10.0)
  if estimator == "k3+":  # straight-through: k3's value, k2's (unbiased) gradient
    k2 = 0.5 * delta**2
    return k2 + jax.lax.stop_gradient(jnp.clip(jnp.exp(-delta) + delta - 1.0, -10.0, 10.0) - k2)
  raise ValueError(f"grpo.kl_estimator: unknown {estimator!r}")


def surrogate(logps: jax.Array, old_logps: jax.Array, adv: jax.Array, mask: jax.Array,
              cfg: GRPOConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-token policy-gradient loss rho [N, S] (to minimise) and per-token clip indicators.

  Args:
    logps: current log-probs [N, S].
    old_logps: behaviour log-probs [N, S].
    adv: advantages broadcast to tokens [N, S].
    mask: {0, 1} float [N, S].
    cfg: surrogate, clip ranges, dual clip.
  """
  lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high
  log_ratio = jnp.clip(logps - old_logps, -20.0, 20.0)
  if cfg.surrogate == "gspo":
    seq = (log_ratio * mask).sum(axis=1, keepdims=True) / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    log_ratio = jnp.minimum(jax.lax.stop_gradient(seq) + logps - jax.lax.stop_gradient(logps), 10.0)
  ratio = jnp.exp(log_ratio)
  if cfg.surrogate == "cispo":
    rho = -jax.lax.stop_gradient(jnp.clip(ratio, lo, hi)) * adv * logps
  else:
    unclipped, clipped = -ratio * adv, -jnp.clip(ratio, lo, hi) * adv
    rho = jnp.maximum(unclipped, clipped)
    if cfg.dual_clip is not None:
      rho = jnp.where(adv < 0, jnp.minimum(rho, -cfg.dual_clip * adv), rho)
  stats = {
      "actor/pg_clipfrac": (jnp.maximum(-ratio * adv, -jnp.clip(ratio, lo, hi) * adv) > -ratio * adv),
      "actor/clip_low": (ratio < lo) & (adv < 0),
      "actor/clip_high": (ratio > hi) & (adv > 0),
      "actor/pg_clipfrac_lower": (adv < 0) & (cfg.dual_clip is not None)
                                 & (-jnp.clip(ratio, lo, hi) * adv > -(cfg.dual_clip or 0.0) * adv),
      "actor/ppo_kl": old_logps - logps,
  }
  return rho, stats


def importance_weights(old_logps: jax.Array, sampler_logps: jax.Array, mask: jax.Array,
                       cfg: GRPOConfig) -> jax.Array:
  """Off-policy correction w [N, S] (spec 5.3) of `cfg.tis_mode`: token TIS, or a sequence mask on the geometric mean
  of the token ratios ("sequence_mask") or on their product, weighted by it ("sequence_product_mask", TRL's rule)."""
  # Clipped per token first: a padded position's garbage (or -inf) sampler log-prob must not reach exp or the mask.
  token_log_ratio = jnp.clip(old_logps - sampler_logps, -20.0, 20.0)
  if cfg.tis_mode == "token":
    return jnp.minimum(jnp.exp(token_log_ratio), cfg.tis_cap)
  log_ratio = (token_log_ratio * mask).sum(axis=1, keepdims=True)
  if cfg.tis_mode == "sequence_mask":
    log_ratio = log_ratio / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
  # Clipped below float32's exp overflow (88.7): a ratio of e^80 is outside any finite band, as an infinite one is.
  ratio = jnp.exp(jnp.clip(log_ratio, -80.0, 80.0))
  keep = (ratio >= cfg.tis_min) & (ratio <= cfg.tis_cap)
  weight = jnp.where(keep, ratio if cfg.tis_mode == "sequence_product_mask" else 1.0, 0.0)
  return jnp.broadcast_to(weight, old_logps.shape).astype(jnp.float32)


def loss(params: Any, batch: dict[str, jax.Array], rng: jax.Array, *, model: ModelConfig, grpo: GRPOConfig,
         rules: sharding.Rules = sharding.DEFAULT_RULES,
         prompt_len: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The GRPO-family loss of one micro-batch, weighted by the global `agg_weights`.

  Returns:
    (loss, metrics): `loss` = agg_total * sum(w * (rho + beta k - c_H H)) / sum(w); metrics
    `actor/pg_loss`, `actor/pg_clipfrac`, `actor/clip_low`, `actor/clip_high`,
    `actor/pg_clipfrac_lower`, `actor/ppo_kl`, `actor/entropy`,
    `actor/kl_loss` (KL in the loss), `actor/is_weight` (truncated IS), and
    `weight` = sum(w), all token averages under the same weights; with
    `sampler_logps` in the batch, `rollout/logp_diff_max`, the largest
    |logp - sampler logp| of the micro-batch; for a Mixture of Experts
    `moe/...` statistics, their auxiliary losses added to the value optimised
    (`model.moe_balance_coef`, `model.moe_z_coef`; off by default).
  """
  del rng
  # With prompt_len, the rows are whole groups of G over one prompt, which then runs once per group. The
  # log-probs and entropy come from the vocabulary projection in chunks (`model.logits_chunk`), never [N, S, V].
  scored, trace = rollout_stats(params, batch, model, group_size=grpo.group_size, prompt_len=prompt_len,
                                    temperature=grpo.sampling.temperature, rules=rules)
  # A token whose predicting position dropped an MoE copy here leaves the loss (`moe.undropped`); the
  # normalisers, taken over the mini-batch before this forward, still count it.
  mask = moe.undropped(batch["loss_mask"].astype(jnp.float32), trace)
  w = batch["agg_weights"] * mask
  total = w.sum()
  denominator = jnp.where(total > 0, total, 1.0)
  logps = scored.log_probs
  adv = batch["advantages"][:, None] * mask
  rho, stats = surrogate(logps, batch["old_logps"], adv, mask, grpo)
  if grpo.tis_cap is not None:  # truncated importance sampling for stale or mismatched rollouts
    is_weight = jax.lax.stop_gradient(importance_weights(batch["old_logps"], batch["sampler_logps"], mask, grpo))
    rho = rho * is_weight
    stats["actor/is_weight"] = is_weight
  entropy = scored.entropy
  adaptive = "entropy_coef" in batch  # static: the adaptive rule passes this update's c_H
  if grpo.entropy_coef == 0 and not adaptive:  # logged only, so no backward pass through the full-vocab entropy
    entropy = jax.lax.stop_gradient(entropy)
  per_token = rho - (batch["entropy_coef"][0] if adaptive else grpo.entropy_coef) * entropy
  mean = lambda x: (w * x).sum() / denominator
  metrics = {k: mean(v.astype(jnp.float32)) for k, v in stats.items()}
  metrics["actor/pg_loss"] = mean(rho)
  metrics["actor/entropy"] = mean(entropy)
  if "sampler_logps" in batch:  # before the first update of a step, this is the sampler-trainer mismatch
    metrics["rollout/logp_diff_max"] = jnp.max(jnp.abs(logps - batch["sampler_logps"]) * mask)
  if grpo.kl_in_loss:
    kl = kl_estimate(logps, batch["ref_logps"], grpo.kl_estimator)
    per_token = per_token + grpo.beta * kl
    metrics["actor/kl_loss"] = mean(kl)
  value = batch["agg_total"][0] * mean(per_token)
  metrics.update(moe.metrics(trace.stats))
  return value + moe.aux_loss(trace.stats, model), {"loss": value, **metrics, "weight": total}


def adaptive_kl_coef(beta: jax.Array, kl: jax.Array, n_steps: int, cfg: GRPOConfig) -> jax.Array:
  """The next KL-in-reward coefficient: beta * (1 + clip(kl / kl_target - 1, -0.2, 0.2) * n_steps / kl_horizon).

  verl's `AdaptiveKLController`: `kl` is the step's measured KL, `n_steps`
  the rollouts it measured (spec section 5.5).
  """
  error = jnp.clip(kl / cfg.kl_target - 1.0, -0.2, 0.2)
  return beta * (1.0 + error * (n_steps / cfg.kl_horizon))


def adaptive_entropy_coef(coef: jax.Array, entropy: jax.Array, cfg: GRPOConfig) -> jax.Array:
  """The next entropy coefficient: c_H + delta while `entropy` <= target, else c_H - delta, within the bounds.

  Skywork-OR1's rule (spec section 5.6); the caller applies c_H to the next
  update only while `entropy` <= target.
  """
  step = jnp.where(entropy <= cfg.entropy_target, cfg.entropy_coef_delta, -cfg.entropy_coef_delta)
  return jnp.clip(coef + step, cfg.entropy_coef_min, cfg.entropy_coef_max)
