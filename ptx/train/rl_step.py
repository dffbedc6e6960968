"""GRPO's fused mode: sample -> reward -> advantages -> updates, as one jitted program.

`make_grpo_step` returns `step(state, batch) -> (state, metrics)`. Inside one compiled executable it samples G completions
per prompt from `state.params` (the KV cache and the parameters never leave
the mesh), scores them with a JAX reward function, computes advantages, and
runs `epochs` passes of `minibatches` optimizer updates with the GRPO loss.
The behaviour log-probs are the sampler's; the trainer's own log-probs of
the same tokens, at the sampling parameters, are computed too and their
largest difference is logged (`rollout/logp_diff_max`): both come from the
same model code, so it must stay at rounding level.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ptx import sharding
from ptx.algorithms import advantages as adv_lib
from ptx.algorithms import grpo
from ptx.config import GRPOConfig, ModelConfig
from ptx.models.decoder import forward
from ptx.sampling.generation import LENGTH, Generation, generate_padded
from ptx.sampling.rules import SamplingConfig
from ptx.train.optimizer import skipped_steps
from ptx.train.state import TrainState
from ptx.train.step import accumulate_gradients

# reward(generation, task) -> float32 [R]; task arrays are already repeated to R = B * G rows.
RewardFn = Callable[[Generation, dict[str, jax.Array]], jax.Array]


def rollout_batch(prompts_BP: jax.Array, lengths_B: jax.Array, gen: Generation, group_size: int) -> dict[str, jax.Array]:
  """The [R, P + N] training batch of a generation: left-padded prompt, then the sampled tokens."""
  P, N = prompts_BP.shape[1], gen.tokens.shape[1]
  tokens = jnp.concatenate([jnp.repeat(prompts_BP, group_size, axis=0), gen.tokens], axis=1)
  columns = jnp.arange(P + N, dtype=jnp.int32)[None, :]
  first = (P - jnp.repeat(lengths_B, group_size))[:, None]
  end = P + gen.lengths[:, None]
  return {
      "tokens": tokens,
      "positions": jnp.maximum(columns - first, 0),
      "segment_ids": ((columns >= first) & (columns < end)).astype(jnp.int32),
      "loss_mask": ((columns >= P) & (columns < end)).astype(jnp.int32),
      "sampler_logps": jnp.concatenate([jnp.zeros((tokens.shape[0], P), jnp.float32), gen.log_probs], axis=1),
  }


def _minibatches(batch: dict[str, jax.Array], n: int, group_size: int) -> dict[str, jax.Array]:
  """[n, R / n, ...]: whole groups, group g in mini-batch g % n (spread over the batch shards)."""

  def split(x):
    groups = x.reshape(x.shape[0] // group_size, group_size, *x.shape[1:])
    per = groups.reshape(groups.shape[0] // n, n, *groups.shape[1:])
    return jnp.swapaxes(per, 0, 1).reshape(n, -1, *x.shape[1:])

  return jax.tree.map(split, batch)


def make_grpo_step(
    *,
    model: ModelConfig,
    cfg: GRPOConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    state_shardings: TrainState,
    reward_fn: RewardFn,
    sampling: SamplingConfig,
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    pad_id: int = 0,
    epochs: int = 1,
    minibatches: int = 1,
    grad_accum: int = 1,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
  """Jits one fused RL step with explicit shardings and a donated state.

  Args:
    model: the model config.
    cfg: the GRPO loss family config (group size, estimator, clipping, KL).
    optimizer: the optax transformation of the state.
    mesh: the device mesh.
    state_shardings: from `state_shardings(..., with_reference=cfg.beta > 0)`.
    reward_fn: the in-graph reward.
    sampling: the sampling rules of the rollouts.
    max_new_tokens: the completion budget N.
    stop_ids: ids that end a completion.
    pad_id: the pad token of prompts and finished rows.
    epochs: passes (mu) over the rollouts per step.
    minibatches: optimizer updates per pass; each normalises over its own rows.
    grad_accum: micro-batches per update.
    rules: sharding rules.

  Returns:
    `step(state, batch) -> (state, metrics)` with batch = {"prompts" [B, P]
    left-padded, "prompt_lengths" [B], "task": reward_fn's arrays [B, ...]}
    (`ptx.rl.prompt_batches.PromptBatches`).
  """
  G = cfg.group_size
  use_reference = cfg.beta > 0 and cfg.kl_placement != "none"
  loss_fn = functools.partial(grpo.loss, model=model, grpo=cfg, rules=rules)
  logps_of = lambda params, b: grpo.token_logps(
      forward(params, b["tokens"], model, positions=b["positions"], segment_ids=b["segment_ids"], rules=rules),
      b["tokens"])

  def step(state: TrainState, batch: dict[str, Any]):
    prompts, prompt_lengths, task = batch["prompts"], batch["prompt_lengths"], batch["task"]
    rng = jax.random.fold_in(state.rng, state.step)
    sample_key, update_key = jax.random.split(rng)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      stops = jnp.broadcast_to(jnp.asarray(stop_ids, jnp.int32), (prompts.shape[0], len(stop_ids)))
      gen = generate_padded(state.params, prompts, prompt_lengths, stops, sample_key, max_new_tokens, cfg=model,
                            sampling=sampling, budget=max_new_tokens, group_size=G, pad_id=pad_id, rules=rules)
      batch = rollout_batch(prompts, prompt_lengths, gen, G)
      mask = batch["loss_mask"].astype(jnp.float32)
      batch["old_logps"] = batch["sampler_logps"]
      trainer_logps = logps_of(state.params, batch)
      rewards = reward_fn(gen, jax.tree.map(lambda x: jnp.repeat(x, G, axis=0), task))
      raw_rewards = rewards
      rewards = rewards + cfg.overlong_penalty * adv_lib.overlong_punishment(
          gen.lengths, cfg.max_response_tokens, cfg.overlong_buffer)
      if use_reference:  # static: the config decides whether a reference exists
        batch["ref_logps"] = logps_of(state.ref_params, batch)
        if cfg.kl_placement == "reward":
          kl = grpo.kl_estimate(batch["old_logps"], batch["ref_logps"], cfg.kl_estimator)
          rewards = rewards - cfg.beta * (kl * mask).sum(axis=1)
      batch["advantages"] = adv_lib.advantages(rewards, G, cfg.advantage, eps=cfg.advantage_eps,
                                               lengths=gen.lengths)
      minis = _minibatches(batch, minibatches, G)

      def update(carry, i):
        params, opt_state = carry
        mb = jax.tree.map(lambda x: x[i % minibatches], minis)
        mb = {**mb, **grpo.aggregation_inputs(mb["loss_mask"], cfg)}
        grads, metrics = accumulate_gradients(loss_fn, params, mb, jax.random.fold_in(update_key, i), grad_accum)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {**metrics, "actor/grad_norm": optax.tree.norm(grads)}

      (params, opt_state), per_update = jax.lax.scan(update, (state.params, state.opt_state),
                                                     jnp.arange(epochs * minibatches))
    metrics = jax.tree.map(jnp.mean, per_update)
    metrics.update(_rollout_metrics(raw_rewards, gen, mask, trainer_logps, batch["sampler_logps"], G, max_new_tokens))
    metrics["skipped_steps"] = skipped_steps(opt_state)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  # Prompts and task fields are small: they arrive as they are and the sampler's
  # constraints shard the rows; the state keeps its layout and is donated.
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(step, in_shardings=(state_shardings, None),
                 out_shardings=(state_shardings, replicated), donate_argnums=0)


def _rollout_metrics(rewards, gen: Generation, mask, trainer_logps, sampler_logps, group_size, max_new_tokens):
  """Reward, length and sampler-trainer agreement metrics (spec section 5.10 names)."""
  lengths = gen.lengths.astype(jnp.float32)
  rewards_BG = rewards.reshape(-1, group_size)
  return {
      "reward/mean": rewards.mean(),
      "reward/std": rewards.std(),
      "frac_reward_zero_std": jnp.mean(~adv_lib.groups_with_signal(rewards, group_size)) if group_size > 1
      else jnp.float32(1.0),
      "response_length/mean": lengths.mean(),
      "response_length/max": lengths.max(),
      "response_length/min": lengths.min(),
      "response_length/clip_ratio": jnp.mean(gen.finish_reasons == LENGTH),
      "rollout/logp_diff_max": jnp.max(jnp.abs(trainer_logps - sampler_logps) * mask),
      "rollout/pass_rate_groups": jnp.mean(jnp.any(rewards_BG > 0, axis=1)),
  }
