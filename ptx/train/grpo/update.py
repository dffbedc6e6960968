"""GRPO's update and the pieces every step kind shares: sampling, the update from scored rollouts, its jit.

The pieces, shared by the fused step (`ptx.train.grpo.fused`), the
host-reward and engine modes (`ptx.train.grpo.host`, `.engine`) and the
episode step (`ptx.train.grpo.episodes`):
  `sample`    G completions per prompt from the policy (base + adapters under
              LoRA), in-graph; the KV cache and parameters never leave the mesh
  `learn`     from scored rollouts: `prepare_rollouts` (masks, trainer and
              reference log-probs, reward shaping, advantages; no parameter
              change), then `update` (`grpo.epochs` passes of
              `grpo.minibatches` optimizer updates with the GRPO loss)
On-policy, the behaviour log-probs are the sampler's; the first update's
forward, still at the sampling parameters, gives the trainer's log-probs of
the same tokens, and their largest difference is logged
(`rollout/logp_diff_max`): both come from the same model code, so it must
stay at rounding level. Both are log-probs of the tempered policy
softmax(logits / `grpo.sampling.temperature`), as is the reference's.
`jit_learn` is `learn` jitted on the mesh with the state donated, as every
step kind but the fused one runs it.

Under LoRA (`lora=`) `state.params` are the adapters: the sampler and the
loss run base + adapters, the optimizer state covers the adapters only, and
the reference log-probs come from the base with the adapters off.

A reward may return named components {name: [R]} (`grpo.reward_combine`).
The adaptive KL-in-reward and entropy coefficients (`grpo.kl_target`,
`grpo.entropy_target`) live in the optimizer state, in the stage
`coefficient_stage` adds, so checkpoints and exact resume keep them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ptx import config_rules
from ptx import sharding
from ptx.algorithms import advantages as adv_lib
from ptx.algorithms import grpo
from ptx.config import GRPOConfig, LoRAConfig
from ptx.model_config import ModelConfig
from ptx.models import moe
from ptx.models.shared_prefix import rollout_stats
from ptx.sampling.generation import LENGTH, Generation, generate_padded
from ptx.train.optimizer import nonfinite_streak, skipped_steps
from ptx.train.grpo.metrics import logprob_gap, rollout_metrics
from ptx.train.state import TrainState
from ptx.train.step import accumulate_gradients, model_params, reference_params, trainable_loss


@dataclasses.dataclass(frozen=True)
class RLSpec:
  """The static description of an RL step: model, loss family (with the rollouts' sampling) and update schedule.

  Attributes:
    model: the model config.
    grpo: the GRPO loss family config (group size, rollout sampling, estimator, clipping, KL, filtering).
    max_new_tokens: the completion budget N.
    stop_ids: ids that end a completion.
    pad_id: the pad token of prompts and finished rows.
    grad_accum: micro-batches per update.
    lora: the adapters' config when `state.params` are LoRA adapters, else None.
    rules: sharding rules.
  """

  model: ModelConfig
  grpo: GRPOConfig
  max_new_tokens: int
  stop_ids: tuple[int, ...]
  pad_id: int = 0
  grad_accum: int = 1
  lora: LoRAConfig | None = None
  rules: sharding.Rules = sharding.DEFAULT_RULES

  def __post_init__(self):
    config_rules.check_grpo(self.grpo, self.lora)
    config_rules.check_routing_replay(self.grpo, self.model)


class Coefficients(NamedTuple):
  """The adaptive loss coefficients, an optimizer-state stage (float32 scalars)."""

  kl_coef: jax.Array  # beta of KL-in-reward
  entropy_coef: jax.Array  # c_H
  entropy_on: jax.Array  # 1 while the last update's mean entropy was <= the target: c_H applies


def coefficient_stage(cfg: GRPOConfig) -> optax.GradientTransformation | None:
  """An optax stage that changes no update and holds `Coefficients`; None when no coefficient adapts.

  A Job chains it after the optimizer (`Job.optimizer`) when `cfg.kl_target`
  or `cfg.entropy_target` is set; `learn` updates it.
  """
  if cfg.kl_target is None and cfg.entropy_target is None:
    return None
  init = lambda params: Coefficients(jnp.float32(cfg.beta), jnp.float32(cfg.entropy_coef), jnp.float32(1.0))
  return optax.GradientTransformation(init, lambda updates, state, params=None: (updates, state))


def _coefficients(opt_state: Any) -> Coefficients:
  """The optimizer state's `Coefficients`, with a clear error when the optimizer lacks the stage."""
  found = optax.tree_utils.tree_get(opt_state, "Coefficients")
  if found is None:
    raise ValueError("grpo.kl_target / grpo.entropy_target keep their coefficients in the optimizer state: chain "
                     "rl_step.coefficient_stage(cfg.grpo) after the optimizer (as Job.optimizer does)")
  return found


def _next_entropy_coef(opt_state: Any, entropy: jax.Array, cfg: GRPOConfig) -> Any:
  """The optimizer state after the adaptive entropy rule saw an update's mean entropy (a non-finite one is ignored)."""
  coefs, ok = _coefficients(opt_state), jnp.isfinite(entropy)
  coef = jnp.where(ok, grpo.adaptive_entropy_coef(coefs.entropy_coef, entropy, cfg), coefs.entropy_coef)
  on = jnp.where(ok, (entropy <= cfg.entropy_target).astype(jnp.float32), coefs.entropy_on)
  return optax.tree_utils.tree_set(opt_state, entropy_coef=coef, entropy_on=on)


def rollout_batch(prompts_BP: jax.Array, lengths_B: jax.Array, gen: Generation,
                  group_size: int) -> dict[str, jax.Array]:
  """The [R, P + N] training batch of a generation: left-padded prompt, then the sampled tokens.

  A generation that recorded its routes (`Generation.routes`) hands them on as `routes` [R, P + N, L, k], which
  the loss's forwards replay (the caller may drop them from the Generation, which needs them no more).
  """
  P, N = prompts_BP.shape[1], gen.tokens.shape[1]
  tokens = jnp.concatenate([jnp.repeat(prompts_BP, group_size, axis=0), gen.tokens], axis=1)
  columns = jnp.arange(P + N, dtype=jnp.int32)[None, :]
  first = (P - jnp.repeat(lengths_B, group_size))[:, None]
  end = P + gen.lengths[:, None]
  batch = {
      "tokens": tokens,
      "positions": jnp.maximum(columns - first, 0),
      "segment_ids": ((columns >= first) & (columns < end)).astype(jnp.int32),
      "loss_mask": ((columns >= P) & (columns < end)).astype(jnp.int32),
      "sampler_logps": jnp.concatenate([jnp.zeros((tokens.shape[0], P), jnp.float32), gen.log_probs], axis=1),
  }
  if gen.routes is not None:
    batch["routes"] = gen.routes
  return batch


def sample(params: Any, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array, spec: RLSpec) -> Generation:
  """G completions of each left-padded prompt [B, P] from the model parameters `params` (call under the mesh).

  With `grpo.routing_replay="rollout"` the Generation carries the experts every MoE layer chose (`routes`).
  """
  stops = jnp.broadcast_to(jnp.asarray(spec.stop_ids, jnp.int32), (prompts.shape[0], len(spec.stop_ids)))
  return generate_padded(params, prompts, prompt_lengths, stops, key, spec.max_new_tokens, cfg=spec.model,
                         sampling=spec.grpo.sampling, budget=spec.max_new_tokens, group_size=spec.grpo.group_size,
                         pad_id=spec.pad_id, tempered_log_probs=True,
                         record_routes=spec.grpo.routing_replay == "rollout", rules=spec.rules)


def batch_logps(params: Any, batch: dict[str, jax.Array], spec: RLSpec) -> tuple[jax.Array, moe.Trace]:
  """Per-token log-probs [R, S] of the batch's tokens under `params` at T = grpo.sampling.temperature (no gradient),
  and its MoE layers' trace: the experts they used ([R, S, L, k]: the batch's `routes` where it has them; None when
  dense) and the tokens they dropped."""
  stats, trace = rollout_stats(params, batch, spec.model, group_size=spec.grpo.group_size,
                               prompt_len=_shared_prompt_len(batch, spec), temperature=spec.grpo.sampling.temperature,
                               rules=spec.rules)
  return jax.lax.stop_gradient(stats.log_probs), trace


def _shared_prompt_len(batch: dict[str, jax.Array], spec: RLSpec) -> int | None:
  """P of a `rollout_batch` (prompt columns, then max_new_tokens sampled ones), when the prompt can be shared.

  Adapters with dropout draw per layer inside the loss, which the cached
  prompt pass does not thread through, so LoRA keeps the plain forward.
  """
  if spec.lora is not None:
    return None
  return batch["tokens"].shape[1] - spec.max_new_tokens


def _minibatches(batch: dict[str, jax.Array], n: int, group_size: int) -> dict[str, jax.Array]:
  """[n, R / n, ...]: whole groups, group g in mini-batch g % n (spread over the batch shards)."""
  n_groups = jax.tree.leaves(batch)[0].shape[0] // group_size
  if n_groups % n:
    raise ValueError(f"grpo.minibatches={n} must divide the {n_groups} prompts (groups) of a step")

  def split(x):
    grouped = x.reshape(x.shape[0] // group_size, group_size, *x.shape[1:])
    per = grouped.reshape(grouped.shape[0] // n, n, *grouped.shape[1:])
    return jnp.swapaxes(per, 0, 1).reshape(n, -1, *x.shape[1:])

  return jax.tree.map(split, batch)


class Prepared(NamedTuple):
  """Scored rollouts made ready for the update (`prepare_rollouts`)."""

  batch: dict[str, jax.Array]  # [R, S] rows with masks, old / reference log-probs and advantages
  metrics: dict[str, jax.Array]  # the rollouts' reward, length, filter and staleness metrics
  kl_coef: jax.Array | float  # beta of the step (adaptive or fixed)
  seq_kl: jax.Array | None  # [R] summed KL of KL-in-reward, for the adaptive coefficient


def learn(state: TrainState, batch: dict[str, jax.Array], gen: Generation, rewards: adv_lib.Rewards, key: jax.Array,
          spec: RLSpec, optimizer: optax.GradientTransformation, *,
          proximal: bool = False) -> tuple[TrainState, dict[str, jax.Array]]:
  """The policy update from scored rollouts: `prepare_rollouts`, then `update` (call under the mesh, inside a jit).

  Args:
    state: the train state; `state.step` counts RL steps.
    batch: `rollout_batch` of the rollouts [R, S], optionally with `keep` [R]
      (0 masks a row out of the loss: an unfilled refill slot).
    gen: the rollouts' Generation (lengths and finish reasons).
    rewards: raw (un-shaped) rewards [R], or named components {name: [R]};
      NaN for unscorable samples.
    key: the update's PRNG key (adapter dropout).
    spec: the static step description.
    optimizer: the optax transformation of the state.
    proximal: the rollouts are off the policy (stale, or sampled by int8
      weights): PPO's old log-probs are recomputed at
      `state`'s parameters and exp(old - sampler), truncated at
      `spec.grpo.tis_cap`, weights the loss (decoupled PPO); else they are
      the sampler's.

  Returns:
    (state, metrics): one RL step later, with spec section 5.10's metrics.
  """
  prepared = prepare_rollouts(state, batch, gen, rewards, spec, proximal=proximal)
  params, opt_state, metrics = update(state, prepared.batch, key, spec, optimizer)
  metrics.update(prepared.metrics, skipped_steps=skipped_steps(opt_state), nonfinite_streak=nonfinite_streak(opt_state))
  cfg = spec.grpo
  if cfg.uses_reference:
    metrics["actor/kl_coef"] = jnp.float32(prepared.kl_coef)
  if cfg.kl_target is not None:  # static
    opt_state, metrics["actor/reward_kl"] = _next_kl_coef(opt_state, prepared.kl_coef, prepared.seq_kl,
                                                          prepared.batch["loss_mask"].astype(jnp.float32), cfg)
  state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return _refresh_reference(state, cfg), metrics


def prepare_rollouts(state: TrainState, batch: dict[str, jax.Array], gen: Generation, rewards: adv_lib.Rewards,
                     spec: RLSpec, *, proximal: bool = False) -> Prepared:
  """Masks, old and reference log-probs, shaped rewards and advantages of scored rollouts (no parameter change).

  Rows leave the loss (mask 0) when unscorable, an unfilled refill slot,
  a zero-variance group under `filter_groups="mask"`, or cut at the budget
  under `mask_truncated`. Arguments as `learn`'s.
  """
  cfg, G = spec.grpo, spec.grpo.group_size
  batch = dict(batch)
  keep = batch.pop("keep", None)
  total = adv_lib.total_reward(rewards, cfg.reward_weights)
  row_mask = ~jnp.isnan(total) if keep is None else ~jnp.isnan(total) & (keep > 0)
  metrics = {}
  if cfg.filter_groups == "mask":  # static: DAPO's cheap alternative, zero-variance groups leave the loss
    signal = adv_lib.groups_with_signal(total, G)
    row_mask = row_mask & jnp.repeat(signal, G)
    metrics = {"filter_groups/evicted": (~signal).sum().astype(jnp.float32), "filter_groups/pass_rate": signal.mean()}
  if cfg.mask_truncated:  # static: overlong filtering
    row_mask = row_mask & (gen.finish_reasons != LENGTH)
  batch["loss_mask"] = batch["loss_mask"] * row_mask[:, None].astype(batch["loss_mask"].dtype)
  # On-policy the old log-probs are the sampler's, and the first update's forward
  # measures the sampler-trainer difference: no extra forward pass. Replay of the old policy's routes (R2) records
  # them in a forward at the step's parameters: the one that recomputes the old log-probs when proximal.
  if proximal or cfg.routing_replay == "old_policy":
    old_logps, old_trace = batch_logps(model_params(state, spec.lora), batch, spec)
    if proximal:  # the old log-probs are this forward's, not the policy's where it dropped a copy
      batch["loss_mask"] = moe.undropped(batch["loss_mask"], old_trace)
    if cfg.routing_replay == "old_policy":
      batch["routes"] = old_trace.routes
  if cfg.uses_reference:  # static: the config decides whether a reference exists
    # The reference routes itself: replay is the policy's.
    batch["ref_logps"], ref_trace = batch_logps(reference_params(state),
                                                {k: v for k, v in batch.items() if k != "routes"}, spec)
    batch["loss_mask"] = moe.undropped(batch["loss_mask"], ref_trace)
  mask = batch["loss_mask"].astype(jnp.float32)
  if proximal:
    batch["old_logps"] = old_logps
    metrics.update(logprob_gap(mask, batch["old_logps"], batch["sampler_logps"]))  # staleness and int8's gap
  else:
    batch["old_logps"] = batch["sampler_logps"]
  shaped = total + cfg.overlong_penalty * adv_lib.overlong_punishment(gen.lengths, cfg.max_response_tokens,
                                                                      cfg.overlong_buffer)
  beta = _coefficients(state.opt_state).kl_coef if cfg.kl_target is not None else cfg.beta
  seq_kl = None
  if cfg.uses_reference:
    if cfg.kl_in_reward:
      seq_kl = (grpo.kl_estimate(batch["old_logps"], batch["ref_logps"], cfg.kl_estimator) * mask).sum(axis=1)
      shaped = shaped - beta * seq_kl
  batch["advantages"] = _advantages(rewards, shaped, total, gen, cfg)
  metrics.update(rollout_metrics(rewards, total, gen, G))
  return Prepared(batch, metrics, beta, seq_kl)


def update(state: TrainState, batch: dict[str, jax.Array], key: jax.Array, spec: RLSpec,
           optimizer: optax.GradientTransformation) -> tuple[Any, Any, dict[str, jax.Array]]:
  """`grpo.epochs` passes of `grpo.minibatches` optimizer updates of the GRPO loss on a prepared batch.

  Returns:
    (params, optimizer state, metrics averaged over the updates; the
    sampler-trainer difference is the first update's, at the sampling
    parameters).
  """
  cfg = spec.grpo
  minis = _minibatches(batch, cfg.minibatches, cfg.group_size)
  # Micro-batches (grad_accum) take strided rows, which breaks groups apart: their prompts are not shared.
  prompt_len = _shared_prompt_len(batch, spec) if spec.grad_accum == 1 else None
  loss_fn = trainable_loss(functools.partial(grpo.loss, model=spec.model, grpo=cfg, rules=spec.rules,
                                             prompt_len=prompt_len), state.base, spec.lora)

  def one_update(carry, i):
    params, opt_state = carry
    mb = jax.tree.map(lambda x: x[i % cfg.minibatches], minis)
    mb = {**mb, **grpo.aggregation_inputs(mb["loss_mask"], cfg)}
    if cfg.entropy_target is not None:  # static: c_H of this update, from the previous update's entropy
      coefs = _coefficients(opt_state)
      entropy_coef = coefs.entropy_coef * coefs.entropy_on
      mb["entropy_coef"] = jnp.full(mb["loss_mask"].shape[:1], entropy_coef)
    grads, metrics = accumulate_gradients(loss_fn, params, mb, jax.random.fold_in(key, i), spec.grad_accum)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics = {**metrics, "actor/grad_norm": optax.tree.norm(grads)}
    if cfg.entropy_target is not None:
      opt_state = _next_entropy_coef(opt_state, metrics["actor/entropy"], cfg)
      metrics["actor/entropy_coef"] = entropy_coef
    return (optax.apply_updates(params, updates), opt_state), metrics

  (params, opt_state), per_update = jax.lax.scan(one_update, (state.params, state.opt_state),
                                                 jnp.arange(cfg.updates_per_step))
  metrics = jax.tree.map(jnp.mean, per_update)
  metrics["rollout/logp_diff_max"] = per_update["rollout/logp_diff_max"][0]  # at the sampling parameters
  return params, opt_state, metrics


def _next_kl_coef(opt_state: Any, beta: jax.Array, seq_kl: jax.Array, mask: jax.Array,
                  cfg: GRPOConfig) -> tuple[Any, jax.Array]:
  """(optimizer state with the next adaptive beta, the step's KL): verl's mean over rollouts of their token-mean KL."""
  lengths = mask.sum(axis=1)
  measured = (seq_kl / jnp.maximum(lengths, 1.0)).sum() / jnp.maximum((lengths > 0).sum(), 1)
  kl_coef = grpo.adaptive_kl_coef(beta, measured, seq_kl.shape[0], cfg)
  return optax.tree_utils.tree_set(opt_state, kl_coef=kl_coef), measured


def _advantages(rewards: adv_lib.Rewards, shaped: jax.Array, total: jax.Array, gen: Generation,
                cfg: GRPOConfig) -> jax.Array:
  """Advantages [R] of the shaped scalar rewards, or GDPO's of the components (the shaping one more, weight 1)."""
  if cfg.reward_combine == "sum_then_normalize":
    return adv_lib.advantages(shaped, cfg.group_size, cfg.advantage, eps=cfg.advantage_eps, lengths=gen.lengths)
  components, weights = adv_lib.components(rewards), adv_lib.component_weights(rewards, cfg.reward_weights)
  if cfg.shapes_reward:  # static: shaping exists
    components, weights = jnp.concatenate([components, (shaped - total)[None]]), (*weights, 1.0)
  return adv_lib.normalize_then_sum(components, weights, cfg.group_size, eps=cfg.advantage_eps)


def _refresh_reference(state: TrainState, cfg: GRPOConfig) -> TrainState:
  """Every `ref_sync_every` steps, ref <- alpha * policy + (1 - alpha) * ref (TRL `sync_ref_model`)."""
  if cfg.ref_sync_every <= 0 or state.ref_params is None:
    return state
  due = state.step % cfg.ref_sync_every == 0
  mixed = jax.tree.map(lambda p, r: jnp.where(due, (cfg.ref_sync_alpha * p + (1 - cfg.ref_sync_alpha) * r)
                                              .astype(r.dtype), r), state.params, state.ref_params)
  return state.replace(ref_params=mixed)


@dataclasses.dataclass(frozen=True)
class GRPOStepKind:
  """What the GRPO step kinds of a Job share: the spec's LoRA, the coefficient stage, no held-out loss."""

  spec: RLSpec

  @property
  def lora(self) -> LoRAConfig | None:
    return self.spec.lora

  def optimizer_stage(self) -> optax.GradientTransformation | None:
    """The adaptive coefficients' optimizer-state stage (`coefficient_stage`), if any."""
    return coefficient_stage(self.spec.grpo)

  def evaluator(self, state_shardings: TrainState, mesh: Mesh, batches: Any) -> None:
    """Raises: a GRPO job has no held-out loss to evaluate."""
    raise ValueError("fit(eval_data=...): a GRPO job has no held-out loss; measure pass@k with ptx.episodes.evaluation")


def step_keys(state: TrainState) -> tuple[jax.Array, jax.Array]:
  """(sampling key, update key) of the state's step: `fold_in(rng, step)`, split."""
  sample_key, update_key = jax.random.split(jax.random.fold_in(state.rng, state.step))
  return sample_key, update_key


def jit_learn(spec: RLSpec, optimizer: optax.GradientTransformation, mesh: Mesh, state_shardings: TrainState, *,
              proximal: bool = False) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
  """`learn` jitted on the mesh: (state, rollouts, gen, rewards) -> (state, metrics), the state donated.

  Args:
    spec: the static step description.
    optimizer: the optax transformation of the state.
    mesh: the device mesh.
    state_shardings: the state's shardings (the output state keeps them).
    proximal: the rollouts come from another policy than the state's (sampled
      before earlier updates, or by int8 weights): the policy's log-probs are
      recomputed and the importance weight capped (`GRPOConfig.tis_cap_for`).
  """
  spec = dataclasses.replace(spec, grpo=dataclasses.replace(spec.grpo, tis_cap=spec.grpo.tis_cap_for(proximal)))

  def learn_fn(state, rollouts, gen, rewards):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return learn(state, rollouts, gen, rewards, step_keys(state)[1], spec, optimizer, proximal=proximal)

  return jax.jit(learn_fn, in_shardings=(state_shardings, None, None, None),
                 out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())), donate_argnums=0)
