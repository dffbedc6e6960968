"""The rules across config fields, checked once before a job compiles.

Each Job builder (`ptx.train.job`) calls `check` first, and `RLSpec` calls
`check_grpo`; a broken rule raises `ConfigError` naming its fields.
"""

from __future__ import annotations

from typing import Literal

import jax
from ptx_kernels import pallas_gpu

from ptx.config import Config, ConfigError, GRPOConfig, LoRAConfig
from ptx.model_config import ModelConfig

# The record kind each job kind reads (`Job.algorithm`: the fused, host-reward and episode GRPO jobs apart).
RECORD_KINDS = {"sft": "sft", "dpo": "preference", "grpo": "rl", "grpo_host": "rl", "grpo_episodes": "rl"}


def check(cfg: Config, algorithm: Literal["sft", "dpo", "grpo", "grpo_host", "grpo_episodes"]) -> None:
  """Every cross-field rule of a job's config, checked before anything compiles.

  The Job builders (`ptx.train.job`) call it first; a single field's range is
  checked by its class (`__post_init__`).

  Args:
    cfg: the job's config.
    algorithm: the job kind, as `Job.algorithm` names it.

  Raises:
    ConfigError: naming the fields of the first broken rule.
  """
  if algorithm not in RECORD_KINDS:
    raise ConfigError(f"unknown algorithm {algorithm!r}; known: {sorted(RECORD_KINDS)}")
  train, data = cfg.train, cfg.data
  if train.steps < 0:
    raise ConfigError(f"train.steps must be >= 0, got {train.steps}")
  for name in ("grad_accum", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
    if getattr(train, name) < 1:
      raise ConfigError(f"train.{name} must be >= 1, got {getattr(train, name)}")
  if data.batch_size < 1:
    raise ConfigError(f"data.batch_size must be >= 1, got {data.batch_size}")
  check_attention(cfg.model, jax.default_backend())
  kind = RECORD_KINDS[algorithm]
  if data.kind != kind:
    raise ConfigError(f"data.kind={data.kind!r}, but {algorithm} reads {kind!r} records: set data.kind={kind}"
                      + ("" if kind == "sft" else " and data.pack=false"))
  if kind == "rl":
    check_grpo(cfg.grpo, cfg.lora if cfg.lora.rank > 0 else None)
    groups = data.batch_size // cfg.grpo.minibatches
    if data.batch_size % cfg.grpo.minibatches:
      raise ConfigError(f"grpo.minibatches={cfg.grpo.minibatches} must divide data.batch_size={data.batch_size} "
                        "(the prompts of a step, each a group)")
    if groups * cfg.grpo.group_size % train.grad_accum:
      raise ConfigError(f"train.grad_accum={train.grad_accum} must divide the {groups * cfg.grpo.group_size} "
                        "rollouts of an update (data.batch_size / grpo.minibatches x grpo.group_size)")
    check_rollout_mode(cfg)
    _check_grpo_kind(cfg, algorithm)
  elif data.batch_size % train.grad_accum:
    raise ConfigError(f"train.grad_accum={train.grad_accum} must divide data.batch_size={data.batch_size}")
  if kind == "preference":
    check_preference_model(cfg.model)
  if data.tiles_per_row and not cfg.model.vision.enabled:
    raise ConfigError(f"data.tiles_per_row={data.tiles_per_row} feeds images to a model without a vision tower "
                      "(model.vision.depth=0): set data.tiles_per_row=0 for text, or use a vision model")


def _check_grpo_kind(cfg: Config, algorithm: str) -> None:
  """What one GRPO job kind cannot do: the fused step samples in-graph, episodes are played exactly and on-policy."""
  g, rollout = cfg.grpo, cfg.rollout
  if algorithm == "grpo" and g.rollouts != "static":
    # The fused mode samples inside its one program; only the host-reward mode can draw from the engine.
    raise ConfigError(f"grpo.rollouts={g.rollouts!r} needs host rewards (an environment or reward functions on rl "
                      "records); the fused in-graph mode samples with 'static' only")
  if algorithm == "grpo_episodes":
    if rollout.mode != "standard" or rollout.kv_dtype != "auto":
      raise ConfigError(f"rollout.mode={rollout.mode}, rollout.kv_dtype={rollout.kv_dtype}: multi-turn episodes are "
                        "sampled exactly, in rollout.mode=standard with rollout.kv_dtype=auto only; set them")
    if g.max_staleness != 0 or g.filter_groups == "refill":
      raise ConfigError(f"multi-turn episodes are played on-policy, all of a step's at once: set "
                        f"grpo.max_staleness=0 (got {g.max_staleness}) and a grpo.filter_groups other than 'refill'")


def check_attention(model: ModelConfig, backend: str) -> None:
  """An attention implementation named outright must run on `backend` ("auto" always does: it picks one that can).

  cuDNN and splash, whose rules depend on the rows and the model's attention, are checked with the job
  (`ptx.train.job.check_attention_kernel`).

  Raises:
    ConfigError: naming model.attention_impl (and model.head_dim) when it cannot.
  """
  if model.attention_impl != "pallas":
    return
  if backend not in ("gpu", "tpu"):
    raise ConfigError(f"model.attention_impl='pallas' runs the GPU or TPU Pallas kernel, and this backend is "
                      f"{backend!r}: use 'auto' (xla or blockwise here) or 'blockwise'")
  widths = {model.qk_head_dim, model.v_head_dim}
  if backend == "gpu" and not all(pallas_gpu.takes_head_dim(w) for w in widths):
    what = "the query/key and value widths of model.mla" if model.mla.enabled else "model.head_dim"
    got = sorted(widths) if model.mla.enabled else model.head_dim
    raise ConfigError(f"model.attention_impl='pallas' on GPU needs {what} a power of two >= 16 (Triton's "
                      f"tiles), got {got}: use 'auto' (xla at this head width) or 'xla'")


def check_rollout_mode(cfg: Config) -> None:
  """`rollout.mode="fast"` samples GRPO's rollouts on the engine, from int8 weights derived from plain parameters;
  `rollout.kv_dtype="int8"` stores the engine's pages in int8.

  Raises:
    ConfigError: naming rollout.mode and the field to set instead.
  """
  if cfg.rollout.kv_dtype != "auto" and cfg.grpo.rollouts != "engine":
    raise ConfigError(f"rollout.kv_dtype={cfg.rollout.kv_dtype} stores the rollout engine's pages: it needs "
                      f"grpo.rollouts=engine (got {cfg.grpo.rollouts!r}) and host rewards; set rollout.kv_dtype=auto "
                      "for the fused mode and static host rollouts")
  if cfg.rollout.mode != "fast":
    return
  if cfg.grpo.rollouts != "engine":
    raise ConfigError(f"rollout.mode=fast samples on the rollout engine: it needs grpo.rollouts=engine (got "
                      f"{cfg.grpo.rollouts!r}) and host rewards (rl records: --data.train_files with --env); the "
                      "fused in-graph mode and static host rollouts sample in rollout.mode=standard only")
  if cfg.lora.rank > 0:
    raise ConfigError(f"rollout.mode=fast quantises plain parameters to int8, and lora.rank={cfg.lora.rank} trains "
                      "adapters: set rollout.mode=standard (or lora.rank=0)")


def check_grpo(cfg: GRPOConfig, lora: LoRAConfig | None) -> None:
  """The cross-field rules of the GRPO family (with the LoRA config, None when off).

  Raises:
    ConfigError: naming the fields.
  """
  if lora is not None and cfg.ref_sync_every > 0:
    raise ConfigError("grpo.ref_sync_every: under LoRA (lora.rank > 0) the reference is the base model, which is "
                      "never refreshed")
  if cfg.reward_combine == "normalize_then_sum" and cfg.advantage != "grpo":
    raise ConfigError(f"grpo.reward_combine='normalize_then_sum' is its own estimator (GDPO); it needs "
                      f"grpo.advantage='grpo', got {cfg.advantage!r}")
  if cfg.kl_target is not None and (cfg.kl_placement != "reward" or cfg.beta <= 0 or cfg.kl_target <= 0
                                    or cfg.kl_horizon <= 0):
    raise ConfigError("grpo.kl_target (adaptive KL) needs grpo.kl_placement='reward', grpo.beta > 0, kl_target > 0 "
                      f"and grpo.kl_horizon > 0; got {cfg.kl_placement!r}, {cfg.beta}, {cfg.kl_target}, "
                      f"{cfg.kl_horizon}")
  if cfg.entropy_target is not None and not (
      cfg.entropy_coef_delta >= 0 and cfg.entropy_coef_min <= cfg.entropy_coef <= cfg.entropy_coef_max):
    raise ConfigError("grpo.entropy_target (adaptive entropy) needs grpo.entropy_coef_delta >= 0 and "
                      "grpo.entropy_coef_min <= grpo.entropy_coef <= grpo.entropy_coef_max; got "
                      f"{cfg.entropy_coef_delta}, {cfg.entropy_coef_min}, {cfg.entropy_coef}, {cfg.entropy_coef_max}")
  if cfg.max_staleness < 0:
    raise ConfigError(f"grpo.max_staleness must be >= 0, got {cfg.max_staleness}")
  if cfg.rollouts == "engine":
    check_engine_rollouts(cfg)
  if cfg.turn_tokens < 1:
    raise ConfigError(f"grpo.turn_tokens must be >= 1, got {cfg.turn_tokens}")
  if cfg.max_response_tokens < 1:
    raise ConfigError(f"grpo.max_response_tokens must be >= 1, got {cfg.max_response_tokens}")


def check_preference_model(model: ModelConfig) -> None:
  """DPO's model runs its MoE layers dropless.

  A lowered capacity drops other copies in the policy's forward than in the
  reference's, so the two sequence log-prob sums that DPO compares would cover
  different tokens.

  Raises:
    ConfigError: naming model.moe_capacity_factor.
  """
  if model.moe.enabled and model.moe_capacity_factor is not None:
    raise ConfigError(f"model.moe_capacity_factor={model.moe_capacity_factor} drops token copies, differently in "
                      "the policy's and the reference's forwards, whose sequence log-prob sums DPO compares: leave "
                      "it None (dropless) for DPO")


def check_routing_replay(cfg: GRPOConfig, model: ModelConfig) -> None:
  """Routing replay needs experts to replay.

  Raises:
    ConfigError: naming the fields.
  """
  if cfg.routing_replay != "none" and not model.moe.enabled:
    raise ConfigError(f"grpo.routing_replay={cfg.routing_replay!r} replays a Mixture of Experts' routes; this model "
                      "has none (model.moe.n_experts = 0): use grpo.routing_replay='none'")


def check_engine_rollouts(cfg: GRPOConfig) -> None:
  """The GRPO options engine rollouts cannot serve (read by `check_grpo` and by the engine step itself).

  Raises:
    ConfigError: naming the fields.
  """
  if cfg.filter_groups == "refill":
    raise ConfigError('grpo.filter_groups="refill" samples further batches on demand, which engine rollouts do not: '
                      'use grpo.rollouts="static", or grpo.filter_groups="mask"')
