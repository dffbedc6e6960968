"""A training job: the step, the reference, LoRA and the optimizer, built once per algorithm from a Config.

Every entry point (the CLI, the demo, recipes, notebooks) turns its `Config`
into a `Job` with one builder per algorithm and hands it to
`ptx.train.loop.fit`, which runs it without interpreting algorithm fields of
the config again:

  sft_job        SFT: the token cross-entropy of `ptx.algorithms.sft`
  dpo_job        DPO family: `ptx.algorithms.dpo` with a frozen reference, a
                 precomputed one (`ptx.train.streams`) or none (SimPO)
  grpo_job       GRPO family, fused: sample, in-graph reward, update in one
                 program (`ptx.train.grpo.update`)
  grpo_host_job  GRPO family, host reward: the device samples ahead while the
                 host scores (`ptx.train.grpo.host`)
  grpo_episode_job  GRPO family over multi-turn episodes in an environment
                 (`ptx.train.grpo.episodes`)

Each builder first runs `ptx.config.check` (every cross-field rule, naming
the fields) and the tokenizer check, so a bad combination fails before
anything compiles. Jobs compare by value: the same config gives equal Jobs
wherever it is built (the data streams and tokenizers are not compared).

A step kind is any frozen object with `lora`, `optimizer_stage()`,
`stream(iterator)`, `build(optimizer, mesh, state_shardings, data)` and
`evaluator(state_shardings, mesh, batches)`; later algorithms plug in by
writing one and a builder.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import optax

from ptx import config as config_lib
from ptx import config_rules
from ptx import sharding
from ptx.algorithms import dpo, sft
from ptx.config import Config, OptimizerConfig
from ptx.model_config import ModelConfig
from ptx.data import image_tokens
from ptx.data.tokenizer import Tokenizer, check_fits
from ptx.models import attention_choice
from ptx.models import decoder
from ptx.models.attention import need_of
from ptx.models.params import trainable_mask, weight_decay_mask
from ptx.train.grpo import token_rewards
from ptx.envs.base import Environment
from ptx.episodes.turn_format import TurnFormat
from ptx.train.optimizer import learning_rate_schedule, make_optimizer
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.mode import RolloutMode
from ptx.train.grpo.engine import EngineGRPOStep
from ptx.train.grpo.episodes import EpisodeGRPOStep
from ptx.episodes.scoring import HostReward
from ptx.train.grpo.host import HostGRPOStep
from ptx.train.grpo.fused import FusedGRPOStep, RewardFn
from ptx.train.grpo.update import RLSpec
from ptx.train.step import Bound, SupervisedStep

Algorithm = Literal["sft", "dpo", "grpo", "grpo_host", "grpo_episodes"]
# The config sections each algorithm reads (printed and saved at the start of a run; `ptx sft --fields` lists them).
SECTIONS = {"sft": ("model", "mesh", "optim", "train", "data", "lora"),
             "dpo": ("model", "mesh", "optim", "train", "data", "dpo", "lora"),
             "grpo": ("model", "mesh", "optim", "train", "data", "grpo", "lora", "rollout"),
             "grpo_host": ("model", "mesh", "optim", "train", "data", "grpo", "lora", "rollout"),
             "grpo_episodes": ("model", "mesh", "optim", "train", "data", "grpo", "lora", "rollout")}


@dataclasses.dataclass(frozen=True)
class Job:
  """What `fit` runs: everything an algorithm decides, decided once.

  Attributes:
    algorithm: "sft", "dpo", "grpo" (fused), "grpo_host" or "grpo_episodes" (multi-turn).
    model: the model config the state is initialised and sharded for.
    rules: the sharding rules (`mesh.param_rules`, `mesh.activation_rules`
      over `ptx.sharding.DEFAULT_RULES`) of the state, batches and steps.
    step: the step kind (`SupervisedStep`, `FusedGRPOStep`, `HostGRPOStep`).
    with_reference: the state keeps a frozen copy of the initial parameters
      (`TrainState.ref_params`); under LoRA the base is the reference and no
      copy is kept.
    optim: the optimizer's hyperparameters.
    updates_per_step: optimizer updates one step makes (GRPO: epochs x
      mini-batches).
    total_updates: the learning-rate schedule's length: train.steps x
      updates_per_step.
    rows: what a training row's segment ids hold (`DataConfig.rows`), which picks the attention kernel.
    row_tokens: tokens of a training row (GRPO: the prompt width plus the longest response).
  """

  algorithm: Algorithm
  model: ModelConfig
  rules: sharding.Rules
  step: SupervisedStep | FusedGRPOStep | HostGRPOStep | EngineGRPOStep | EpisodeGRPOStep
  with_reference: bool
  optim: OptimizerConfig
  updates_per_step: int
  total_updates: int
  rows: str
  row_tokens: int

  def attention(self) -> tuple[str, str]:
    """(implementation, reason) of the attention the training forward runs (`decoder.attention_row`); under the mesh."""
    return decoder.attention_row(self.model, self.row_tokens, self.rows, self.rules)

  @property
  def lora(self):
    """The LoRA config when the job trains adapters over a frozen base, else None."""
    return self.step.lora

  @property
  def sections(self) -> tuple[str, ...]:
    """The config sections this job reads."""
    return SECTIONS[self.algorithm]

  def optimizer(self) -> optax.GradientTransformation:
    """AdamW over `total_updates` (decaying matrices only; every adapter), then the step's own stage if any."""
    # Adapters are all matrices, all trained; a full model's buffers (a router's correction bias) never change.
    full = self.lora is None
    optimizer = make_optimizer(self.optim, self.total_updates, weight_decay_mask(self.model) if full else None,
                               trainable_mask(self.model) if full else None)
    stage = self.step.optimizer_stage()
    return optimizer if stage is None else optax.chain(optimizer, stage)

  def learning_rate(self, update: int) -> float:
    """The scheduled learning rate of optimizer update `update` (0-based)."""
    return float(learning_rate_schedule(self.optim, self.total_updates)(update))


def sft_job(cfg: Config, tokenizer: Tokenizer) -> Job:
  """The SFT job of `cfg` (records of `data.kind="sft"`)."""
  rules = _check(cfg, "sft", tokenizer)
  step = SupervisedStep(loss=Bound.of(sft.loss, model=cfg.model, rules=rules, rows=cfg.data.rows),
                        grad_accum=cfg.train.grad_accum, lora=_lora(cfg))
  return _job(cfg, "sft", step, rules, with_reference=False, updates_per_step=1)


def dpo_job(cfg: Config, tokenizer: Tokenizer) -> Job:
  """The DPO-family job of `cfg` (`dpo.loss_type`; reference per `dpo.reference_model`)."""
  rules = _check(cfg, "dpo", tokenizer)
  frozen = cfg.dpo.reference_model == "frozen"
  step = SupervisedStep(loss=Bound.of(dpo.loss, model=cfg.model, dpo=cfg.dpo, rules=rules),
                        prepare=Bound.of(dpo.prepare, model=cfg.model, rules=rules) if frozen else None,
                        grad_accum=cfg.train.grad_accum, lora=_lora(cfg))
  return _job(cfg, "dpo", step, rules, with_reference=frozen, updates_per_step=1)


def grpo_job(cfg: Config, tokenizer: Tokenizer, reward_fn: RewardFn = token_rewards.target_reward) -> Job:
  """The fused GRPO job of `cfg`: `reward_fn(generation, task)` is computed in-graph.

  Args:
    cfg: the job config.
    tokenizer: its eos ends a completion, its pad fills prompts; it decodes the transcripts (`grpo.samples_every`).
    reward_fn: the in-graph reward; the default scores exact answers
      against the prompt batches' targets (`ptx.train.streams.grpo_prompts`
      with `in_graph=True`).
  """
  rules = _check(cfg, "grpo", tokenizer)
  return _job(cfg, "grpo", FusedGRPOStep(_rl_spec(cfg, tokenizer, rules), reward_fn, tokenizer), rules,
              with_reference=cfg.grpo.uses_reference, updates_per_step=cfg.grpo.updates_per_step)


def grpo_host_job(cfg: Config, tokenizer: Tokenizer, reward: HostReward) -> Job:
  """The host-reward GRPO job of `cfg`: `reward(tokens, lengths, tasks)` scores on the host while the device samples.

  Args:
    cfg: the job config (`grpo.max_staleness` batches sampled ahead).
    tokenizer: its eos ends a completion, its pad fills prompts; it decodes the transcripts (`grpo.samples_every`).
    reward: the host reward, e.g. `ptx.episodes.scoring.EnvReward` of an
      environment, or `ptx.train.reward_functions.RewardFunctions`.
  """
  rules = _check(cfg, "grpo_host", tokenizer)
  spec = _rl_spec(cfg, tokenizer, rules)
  step = (HostGRPOStep(spec, reward, tokenizer) if cfg.grpo.rollouts == "static"
          else EngineGRPOStep(spec, reward, _engine_config(cfg, ahead=cfg.grpo.max_staleness),
                              RolloutMode.of(cfg.rollout), tokenizer))
  return _job(cfg, "grpo_host", step, rules, with_reference=cfg.grpo.uses_reference,
              updates_per_step=cfg.grpo.updates_per_step)


def grpo_episode_job(cfg: Config, tokenizer: Tokenizer, env: Environment) -> Job:
  """The multi-turn GRPO job of `cfg`: each step plays G episodes of every task in `env`, then updates on them.

  Args:
    cfg: the job config: `grpo.turn_tokens` per turn, `grpo.max_response_tokens`
      for all an episode adds after its first prompt (`data.seq_len` tokens at most).
    tokenizer: encodes prompts and replies (with its chat template, else ChatML).
    env: the multi-turn environment.

  Raises:
    ConfigError: for settings episodes do not have (they are played on-policy, on the engine).
  """
  rules = _check(cfg, "grpo_episodes", tokenizer)
  g = cfg.grpo
  step = EpisodeGRPOStep(_rl_spec(cfg, tokenizer, rules), env, TurnFormat.of(tokenizer), _engine_config(cfg, ahead=0),
                         g.turn_tokens, g.episode_lockstep)
  return _job(cfg, "grpo_episodes", step, rules, with_reference=g.uses_reference, updates_per_step=g.updates_per_step)


def _engine_config(cfg: Config, *, ahead: int) -> EngineConfig:
  """The rollout engine of a host-reward or episode job: slots for the batch and the `ahead` ones sampled ahead.

  With `rollout.pages` 0 the pool holds every slot's sequence at its
  worst case (prompt width plus budget) without sharing a group's prompt
  pages, so admission waits only for slots: a resumed engine, which
  re-admits its sequences one by one, admits them exactly as the
  uninterrupted one did.
  """
  g, r = cfg.grpo, cfg.rollout
  seqs = cfg.data.batch_size * g.group_size * (1 + ahead)
  return EngineConfig.sized(seqs, cfg.data.seq_len + g.max_response_tokens, pages=r.pages, page_size=r.page_size,
                            decode_steps=r.decode_steps, prefill_rows=min(seqs, 8), admission=r.admission)


def _check(cfg: Config, algorithm: str, tokenizer: Tokenizer) -> sharding.Rules:
  """Every rule of `cfg` for `algorithm` and `tokenizer`; returns the config's sharding rules."""
  config_rules.check(cfg, algorithm)
  check_attention_kernel(cfg.model, jax.default_backend(), cfg.data.rows, cfg.data.seq_len)
  try:
    check_fits(tokenizer, cfg.model.vocab_size, "model.vocab_size")
    if cfg.data.tiles_per_row:
      _check_image_token(tokenizer, cfg.model.vision.image_token_id, cfg.data.tiles_per_row)
    return sharding.rules_of(cfg.mesh)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from e


def _check_image_token(tokenizer: Tokenizer, model_id: int, tiles_per_row: int) -> None:
  """The tokenizer's `<image>`, whose positions take the features, is one token, the model's image token."""
  try:
    found = image_tokens.image_token_id(tokenizer)
  except ValueError as e:
    raise ValueError(f"data.tiles_per_row={tiles_per_row}: {e}") from None
  if found != model_id:
    raise ValueError(f"data.tiles_per_row={tiles_per_row}: the tokenizer's {image_tokens.IMAGE} is id {found}, but "
                     f"model.vision.image_token_id={model_id}: use the model's own tokenizer")


def check_attention_kernel(model: ModelConfig, backend: str, rows: str, length: int) -> None:
  """cuDNN or splash, named outright (`model.attention_impl`), must compute the job's attention.

  Args:
    model: the model config.
    backend: "cpu", "gpu" or "tpu".
    rows: what the training rows' segment ids hold (`DataConfig.rows`).
    length: tokens per training row.

  Raises:
    ConfigError: naming model.attention_impl and the reason of `ptx.models.attention_choice.refusal`.
  """
  if model.attention_impl not in ("cudnn", "splash"):
    return
  need = need_of(**decoder.attention_facts(model, length, rows))
  reason = attention_choice.refusal(model.attention_impl, dataclasses.replace(
      need, platform=backend if backend in ("gpu", "tpu") else "cpu", interpreted=False))
  if reason is not None:
    raise config_lib.ConfigError(f"model.attention_impl={model.attention_impl!r} cannot run this job: {reason}; "
                                 "use 'auto'")


def _lora(cfg: Config):
  return cfg.lora if cfg.lora.rank > 0 else None


def _rl_spec(cfg: Config, tokenizer: Tokenizer, rules: sharding.Rules) -> RLSpec:
  return RLSpec(model=cfg.model, grpo=cfg.grpo, max_new_tokens=cfg.grpo.max_response_tokens,
                stop_ids=(tokenizer.eos_id,), pad_id=tokenizer.pad_id, grad_accum=cfg.train.grad_accum,
                lora=_lora(cfg), rules=rules)


def _job(cfg: Config, algorithm: Algorithm, step: Any, rules: sharding.Rules, *, with_reference: bool,
         updates_per_step: int) -> Job:
  response = cfg.grpo.max_response_tokens if algorithm.startswith("grpo") else 0
  return Job(algorithm=algorithm, model=cfg.model, rules=rules, step=step,
             with_reference=with_reference, optim=cfg.optim, updates_per_step=updates_per_step,
             total_updates=cfg.train.steps * updates_per_step, rows=cfg.data.rows,
             row_tokens=cfg.data.seq_len + response)
