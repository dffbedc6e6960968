"""Typed, frozen configuration for every ptx job.

A job's whole configuration is one `Config` tree of frozen dataclasses. Each
field has a default and a comment; a single field's range is checked by its
class. Reading and writing configs (JSON, `--model.d_model=256` overrides)
is `ptx.config_io`; the rules across fields are `ptx.config_rules`.

The model section (`ModelConfig`, its presets) is `ptx.model_config`. This
module sits at the bottom of the import graph: it imports nothing from ptx
but that.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from ptx.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the device mesh axes; -1 takes the remaining devices."""

  # Pure data parallelism (replicated parameters).
  data: int = 1
  # Data parallelism with parameters and optimizer state sharded (FSDP/ZeRO-3).
  fsdp: int = -1
  # Expert parallelism: Mixture-of-Experts layers' experts split over it, their tokens exchanged by all-to-all
  # (model.moe_impl "expert_parallel"); every other weight and the batch shard over it as over fsdp. 1: none.
  expert: int = 1
  # Tensor (model) parallelism over heads, MLP and vocabulary.
  tensor: int = 1
  # Sequence (context) parallelism, used by ring attention.
  seq: int = 1
  # Parameter layout overrides of ptx.sharding.DEFAULT_RULES, each "logical=mesh_axis[,mesh_axis]"
  # ("vocab=" replicates), e.g. ("mlp=fsdp",); ptx.sharding lists the logical axes.
  param_rules: tuple[str, ...] = ()
  # Activation layout overrides, in the same form (e.g. ("batch=data",)).
  activation_rules: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with linear warmup, cosine decay and global-norm clipping."""

  # Peak learning rate (0 keeps the parameters as they are: a check that a run starts from given weights).
  lr: float = 3e-4
  # Steps of linear warmup from 0 to lr.
  warmup_steps: int = 10
  # Final learning rate as a fraction of lr at the end of the cosine decay.
  min_lr_ratio: float = 0.1
  # Adam beta1.
  b1: float = 0.9
  # Adam beta2.
  b2: float = 0.95
  # Adam epsilon.
  eps: float = 1e-8
  # Decoupled weight decay, applied to matrices only (not norms, biases).
  weight_decay: float = 0.0
  # Clip gradients to this global norm (0: no clipping).
  clip_norm: float = 1.0

  def __post_init__(self):
    if not (math.isfinite(self.lr) and self.lr >= 0):
      raise ValueError(f"optim.lr must be finite and >= 0, got {self.lr}")
    if self.warmup_steps < 0:
      raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
      raise ValueError(f"optim.b1 and optim.b2 must be in [0, 1), got {self.b1} and {self.b2}")
    for name in ("eps", "weight_decay", "clip_norm"):
      if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
        raise ValueError(f"optim.{name} must be finite and >= 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The training loop: length, accumulation, seed, logging."""

  # Optimizer steps to run (also the length of the cosine schedule).
  steps: int = 300
  # Micro-batches per optimizer step; gradients are accumulated in-graph.
  grad_accum: int = 1
  # Seed for parameter init, data order and the per-step RNG.
  seed: int = 0
  # Log metrics every this many steps.
  log_every: int = 10
  # Evaluate on the eval data every this many steps (and after the last).
  eval_every: int = 100
  # Save a checkpoint every this many steps (and after the last, and on SIGTERM).
  checkpoint_every: int = 100
  # Keep the newest this many checkpoints.
  keep_checkpoints: int = 3
  # Stop the run (non-zero exit, no export) after this many consecutive optimizer steps with non-finite
  # gradients, which are skipped; 0 never stops. Checkpoints are not written during such a streak.
  max_nonfinite_steps: int = 10
  # Before the first step, compile the step and refuse the run (OutOfMemory, naming the settings to lower) when
  # XLA's estimate of its memory exceeds 90% of what the devices (on CPU: the host) have free.
  memory_check: bool = True


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where records come from and how they become [batch, seq] arrays."""

  # JSONL files of training records (read in order as one sequence).
  train_files: tuple[str, ...] = ()
  # JSONL files of evaluation records (empty: no evaluation).
  eval_files: tuple[str, ...] = ()
  # "byte" for the built-in byte tokenizer, or a directory with tokenizer.json.
  tokenizer: str = "byte"
  # Record kind: "sft", "preference" or "rl" (see ptx.data.records).
  kind: Literal["sft", "preference", "rl"] = "sft"
  # Sequences per step over all hosts; each host makes batch_size / process_count.
  batch_size: int = 16
  # Tokens per row (T).
  seq_len: int = 2048
  # First-fit packing of several sequences per row ("sft" only); else one per row.
  pack: bool = True
  # Open rows of the packer per host (more: denser, more held back).
  num_bins: int = 64
  # Seed of the shuffle; each epoch gets its own order from it.
  seed: int = 0
  # Shuffle records (off: source order).
  shuffle: bool = True
  # Passes over the source; None repeats forever.
  num_epochs: int | None = None
  # Bad records: "raise" (error naming file and line) or "skip" (counted).
  on_error: Literal["raise", "skip"] = "raise"
  # Records longer than seq_len: "truncate" (keep the head) or "drop" (counted).
  overlong: Literal["truncate", "drop"] = "truncate"
  # Fields an "rl" record must carry for its environment (e.g. ("answer",)).
  task_fields: tuple[str, ...] = ()
  # Reader threads for decoding and tokenizing.
  num_threads: int = 2
  # Elements read ahead of the packer.
  prefetch: int = 128
  # Image tiles of a row (N of its [N, 3, S, S] pixel_values, a static shape), "sft" only; 0: text only, records
  # with image parts refused. A row packs sequences up to seq_len tokens and tiles_per_row tiles together.
  tiles_per_row: int = 0
  # Tiles along an image's longest edge before its global tile (the processor's size["longest_edge"] over the
  # tile's; the hub's Idefics3 and SmolVLM: 4, up to 4 x 4 + 1 tiles an image); 1: every image one tile.
  image_tiles_per_edge: int = 4

  def __post_init__(self):
    if self.kind not in ("sft", "preference", "rl"):
      raise ValueError(f"DataConfig.kind must be sft, preference or rl, got {self.kind!r}")
    if self.tiles_per_row < 0 or self.image_tiles_per_edge < 1:
      raise ValueError(f"DataConfig: tiles_per_row must be >= 0 and image_tiles_per_edge >= 1, got "
                       f"{self.tiles_per_row}, {self.image_tiles_per_edge}")
    if self.tiles_per_row and self.kind != "sft":
      raise ValueError(f"DataConfig: images (tiles_per_row={self.tiles_per_row}) reach sft records only for now; "
                       f"set tiles_per_row=0 for {self.kind!r}")
    if self.on_error not in ("raise", "skip") or self.overlong not in ("truncate", "drop"):
      raise ValueError(f"DataConfig: bad policy on_error={self.on_error!r} overlong={self.overlong!r}")
    if self.pack and self.kind != "sft":
      raise ValueError(f"DataConfig: packing is for sft records; set pack=False for {self.kind!r}")

  @property
  def rows(self) -> str:
    """What a training row's segment ids hold (`ptx.models.attention_choice.RowLayout`), which picks its kernel.

    Packed SFT rows hold several sequences; unpacked SFT and preference rows one sequence from column 0, then
    padding; RL rows a left-padded prompt, then its completion, which only segment ids can describe.
    """
    return "padded_right" if self.kind == "preference" or (self.kind == "sft" and not self.pack) else "packed"


@dataclasses.dataclass(frozen=True)
class DPOConfig:
  """Preference optimisation losses (see ptx.algorithms.dpo for the formulas)."""

  # "sigmoid" (DPO; with label_smoothing > 0: conservative DPO), "ipo", "hinge" or "simpo".
  loss_type: Literal["sigmoid", "ipo", "hinge", "simpo"] = "sigmoid"
  # Inverse temperature of the implicit reward.
  beta: float = 0.1
  # Conservative DPO: assumed probability that a preference label is flipped.
  label_smoothing: float = 0.0
  # SimPO: target reward margin gamma (in reward units, i.e. after beta).
  simpo_gamma: float = 0.5
  # Reference log-probs: "frozen" (a frozen parameter copy, a forward per step) or "precomputed" (one pass over the
  # data before training, saved in OUT/reference_logps/; no second parameter tree while training).
  reference: Literal["frozen", "precomputed"] = "frozen"

  @property
  def reference_model(self) -> Literal["none", "frozen", "precomputed"]:
    """Where the reference log-probs come from: "none" for reference-free SimPO, else `reference`."""
    return "none" if self.loss_type == "simpo" else self.reference


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How the next token is drawn from the logits (`ptx.sampling.rules`)."""

  # Take the most likely token (the other fields are then ignored).
  greedy: bool = False
  # Divide the logits by this before truncating.
  temperature: float = 1.0
  # Keep the k most likely tokens (0: off).
  top_k: int = 0
  # Keep the smallest set of most likely tokens whose probability reaches top_p (1.0: off).
  top_p: float = 1.0
  # Keep tokens at least min_p times as likely as the most likely one (0.0: off).
  min_p: float = 0.0

  def __post_init__(self):
    if self.temperature <= 0:
      raise ValueError(f"sampling.temperature must be > 0 (use greedy=True), got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
    if not 0 <= self.min_p <= 1:
      raise ValueError(f"sampling.min_p must be in [0, 1], got {self.min_p}")


# The cap of the importance weight for stale (or int8-sampled) rollouts when `grpo.tis_cap` is unset.
STALE_TIS_CAP = 2.0


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """The GRPO loss family (docs/grpo-loss.md); `GRPO_PRESETS` names the standard mixes."""

  # Sequences sampled per prompt (G).
  group_size: int = 4
  # How rollouts are drawn (never greedily: a group needs G different samples). Every log-prob of the loss
  # (behaviour, policy, reference) and the entropy are those of softmax(logits / sampling.temperature),
  # untruncated, as in TRL and verl: top-k/p and min-p rollouts are slightly off the trained policy.
  sampling: SamplingConfig = SamplingConfig()
  # "grpo", "grpo_no_std" (Dr.GRPO), "grpo_batch_std", "rloo" or "reinforce_pp_baseline".
  advantage: Literal["grpo", "grpo_no_std", "grpo_batch_std", "rloo", "reinforce_pp_baseline"] = "grpo"
  # Epsilon added to the standard deviation of std-normalised advantages.
  advantage_eps: float = 1e-6
  # Surrogate: "ppo_clip" (token ratios), "gspo" (sequence ratio) or "cispo" (clipped-IS REINFORCE).
  surrogate: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
  # Lower clip range of the ratio (1 - epsilon_low).
  epsilon_low: float = 0.2
  # Upper clip range of the ratio (1 + epsilon_high); DAPO clip-higher uses 0.28.
  epsilon_high: float = 0.2
  # Dual-clip constant c > 1 bounding the loss of negative advantages (None: off).
  dual_clip: float | None = None
  # "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "prompt_mean" or
  # "token_sum" (no normaliser, for custom scaling).
  loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
                         "prompt_mean", "token_sum"] = "token_mean"
  # Maximum response tokens: Dr.GRPO's constant C and the overlong cap L_max.
  max_response_tokens: int = 256
  # KL to the reference: "none", "loss" (added to the loss) or "reward" (subtracted from rewards).
  kl_placement: Literal["none", "loss", "reward"] = "loss"
  # KL estimator: "k1", "k2", "k3" or "k3+" (value of k3, gradient of k2: straight-through).
  kl_estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
  # KL coefficient beta; a reference model exists only when beta > 0 and kl_placement != "none" (`uses_reference`).
  beta: float = 0.001
  # Entropy bonus coefficient c_H (entropy is always logged).
  entropy_coef: float = 0.0
  # DAPO soft overlong punishment buffer L_cache in tokens (0: off).
  overlong_buffer: int = 0
  # Weight lambda of the overlong punishment.
  overlong_penalty: float = 1.0
  # Truncated importance-sampling cap C on exp(old - sampler) per token (None: off).
  tis_cap: float | None = None
  # Zero-variance groups (DAPO dynamic sampling on the un-shaped reward): "none" keeps them, "mask" keeps them
  # with m = 0, "refill" samples further prompts in up to max_refill_rounds rounds to fill B kept groups.
  filter_groups: Literal["none", "mask", "refill"] = "none"
  # "refill": extra rounds of B prompts each (a step reads B * (1 + rounds) prompts, all counted consumed).
  max_refill_rounds: int = 2
  # Reference refresh ref <- alpha * policy + (1 - alpha) * ref every this many steps (0: never).
  ref_sync_every: int = 0
  # Mixing weight alpha of the reference refresh.
  ref_sync_alpha: float = 1.0
  # Host-reward mode: batches the sampler may run ahead of the update (0: on-policy, as the fused mode).
  max_staleness: int = 1
  # Host-reward mode's sampler: "static" (`generate` on each batch) or "engine" (`ptx.sampling.engine`: continuous
  # batching over paged KV, groups scored as they finish, partial rollouts across updates; `ptx.train.grpo.engine`).
  rollouts: Literal["static", "engine"] = "static"
  # Mixture-of-Experts routing replay: "none" (each forward routes its tokens itself); "rollout" (R3: the policy's
  # forwards of the update use the experts the sampler chose for each token, in any rollout mode, gate weights from
  # the live router, so it still learns); "old_policy" (R2: the experts a forward at the step's starting parameters
  # chose, one forward more when on-policy). The reference routes itself.
  routing_replay: Literal["none", "rollout", "old_policy"] = "none"
  # Multi-turn environments (`ptx grpo --env calculator`): tokens the model samples in one turn at most;
  # max_response_tokens bounds all an episode adds after its prompt, its turns and the environment's replies.
  turn_tokens: int = 64
  # Multi-turn environments: tools' replies join the engine only when it can run nothing else, all at once, so a
  # step's log-probs do not depend on tool timing and a resumed run trains bitwise alike. False: each reply joins as
  # its tool returns (faster with slow tools); tokens still reproduce, log-probs only to float rounding.
  episode_lockstep: bool = True
  # Overlong filtering: completions cut at max_response_tokens leave the loss (m = 0).
  mask_truncated: bool = False
  # Importance correction with tis_cap, for a sequence's log-ratios d_t = old - sampler over its response tokens:
  # "token": min(exp(d_t), tis_cap) per token (TRL's token_truncate).
  # "sequence_mask": 1 while tis_min <= exp(mean_t d_t) <= tis_cap, else 0, for every token (a gate on the geometric
  #   mean, as in OpenRLHF's and NeMo-RL's seq-mask-tis, without their token weights; length-invariant).
  # "sequence_product_mask": r = exp(sum_t d_t), the sequence's likelihood ratio; r while tis_min <= r <= tis_cap,
  #   else 0 (TRL's sequence_mask, its default; longer sequences leave the band sooner).
  tis_mode: Literal["token", "sequence_mask", "sequence_product_mask"] = "token"
  # Lower bound C_min of the sequence modes.
  tis_min: float = 0.0
  # A reward of named components ({name: [R]}): "sum_then_normalize" (their weighted sum is R) or
  # "normalize_then_sum" (GDPO: each component group-normalised, weighted sum, then normalised over the batch).
  reward_combine: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
  # Weights of the reward components in sorted-name order (empty: all 1).
  reward_weights: tuple[float, ...] = ()
  # Adaptive KL-in-reward coefficient: the target KL (None: beta stays fixed); each step
  # beta <- beta * (1 + clip(KL / kl_target - 1, -0.2, 0.2) * rollouts / kl_horizon).
  kl_target: float | None = None
  # Horizon of the adaptive KL coefficient, in rollouts (verl's and OpenRLHF's unit).
  kl_horizon: int = 10000
  # Adaptive entropy coefficient: the target mean entropy (None: c_H stays entropy_coef); c_H applies to the first
  # update, then only while the last update's mean entropy is <= target, and moves +-entropy_coef_delta each update.
  entropy_target: float | None = None
  # Step of the adaptive entropy coefficient per optimizer update.
  entropy_coef_delta: float = 0.0
  # Lower bound of the adaptive entropy coefficient.
  entropy_coef_min: float = 0.0
  # Upper bound of the adaptive entropy coefficient.
  entropy_coef_max: float = 1.0
  # PPO epochs (mu): passes over one step's rollouts.
  epochs: int = 1
  # Optimizer updates per epoch, each over whole groups (group g in mini-batch g % minibatches), each normalising
  # over its own rows; must divide the prompts of a step.
  minibatches: int = 1
  # Transcripts of what the policy sampled, OUT/samples/step_N.jsonl (`ptx.train.grpo.samples`): written for the
  # first step and every this many steps (0: none). Changes nothing trained, so a resumed run may change it.
  samples_every: int = 10
  # Rows a transcript holds: the step's first rows (whole groups of G first), at most the step's rows.
  samples_rows: int = 8
  # Bytes a transcript file holds at most: long texts are cut in the middle (a marker says how much), and a row
  # that still does not fit is left out (a last line counts them).
  samples_max_bytes: int = 1 << 20

  def __post_init__(self):
    if self.sampling.greedy:
      raise ValueError("grpo.sampling.greedy: GRPO needs sampled rollouts; a greedy group's G completions are equal")
    if self.epochs < 1 or self.minibatches < 1:
      raise ValueError(f"grpo.epochs and grpo.minibatches must be >= 1, got {self.epochs} and {self.minibatches}")
    if self.tis_min < 0 or (self.tis_cap is not None and self.tis_min > self.tis_cap):
      raise ValueError(f"grpo.tis_min must be in [0, grpo.tis_cap], got {self.tis_min} with tis_cap {self.tis_cap}")
    if self.samples_every < 0 or self.samples_rows < 1 or self.samples_max_bytes < 4096:
      raise ValueError(f"grpo.samples_every must be >= 0, grpo.samples_rows >= 1 and grpo.samples_max_bytes >= 4096, "
                       f"got {self.samples_every}, {self.samples_rows} and {self.samples_max_bytes}")

  @property
  def refill_rounds(self) -> int:
    """Rounds of B prompts one fused step may sample: 1, plus `max_refill_rounds` under `filter_groups="refill"`."""
    return 1 + (self.max_refill_rounds if self.filter_groups == "refill" else 0)

  @property
  def kl_in_loss(self) -> bool:
    """Whether the loss carries a KL penalty to the reference (`kl_placement="loss"`, beta > 0)."""
    return self.kl_placement == "loss" and self.beta > 0

  @property
  def kl_in_reward(self) -> bool:
    """Whether the reward is shaped by a KL penalty to the reference (`kl_placement="reward"`, beta > 0)."""
    return self.kl_placement == "reward" and self.beta > 0

  @property
  def shapes_reward(self) -> bool:
    """Whether rewards are shaped before the advantages: DAPO's overlong punishment, or a KL-in-reward penalty."""
    return self.overlong_buffer > 0 or self.kl_in_reward

  @property
  def uses_reference(self) -> bool:
    """Whether the loss reads a reference policy: a KL term with a positive coefficient."""
    return self.beta > 0 and self.kl_placement != "none"

  @property
  def updates_per_step(self) -> int:
    """Optimizer updates per RL step: the learning-rate schedule spans steps times this."""
    return self.epochs * self.minibatches

  def tis_cap_for(self, proximal: bool) -> float | None:
    """The importance weight's cap for rollouts of a proximal policy (stale, or sampled by int8 weights) or not:
    `tis_cap` when set, else `STALE_TIS_CAP` for proximal rollouts and none for on-policy ones."""
    return STALE_TIS_CAP if proximal and self.tis_cap is None else self.tis_cap


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Low-rank adapters (LoRA): train W + (alpha / rank) A B with W frozen (see ptx.models.lora)."""

  # Adapter rank r; 0 turns LoRA off (full fine-tuning).
  rank: int = 0
  # Scale numerator: the adapter's update is multiplied by alpha / rank.
  alpha: float = 16.0
  # Dropout rate on the adapter's input during training.
  dropout: float = 0.0
  # Adapted projections among q, k, v, o (attention) and gate, up, down (MLP).
  targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

  def __post_init__(self):
    unknown = [t for t in self.targets if t not in ("q", "k", "v", "o", "gate", "up", "down")]
    if self.rank < 0 or not 0.0 <= self.dropout < 1.0 or unknown or not self.targets:
      raise ValueError(f"LoRAConfig: bad rank={self.rank}, dropout={self.dropout} or targets={self.targets}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out suites evaluated at checkpoints against the stage a run started from (`ptx.train.checkpoint_evals`)."""

  # Suites of `ptx.envs.suites` (arithmetic, countdown, needle, reasoning_gym, the benchmarks humaneval,
  # humaneval_held_out and bfcl, and the multi-turn calculator, terminal and docqa; math, code, shell, exact read
  # `files`) or of `ptx.episodes.likelihood` (choice, perplexity: `files` too); empty: none.
  suites: tuple[str, ...] = ()
  # Task files of the file suites, each "suite=path.jsonl" (e.g. ("math=held_out.jsonl",)).
  files: tuple[str, ...] = ()
  # Tasks per suite (the first n of its held-out stream or file).
  n: int = 64
  # Samples per task: pass@1, pass@k and mean@k are over k samples.
  k: int = 4
  # The length budget of a completion (each turn of a multi-turn suite).
  max_new_tokens: int = 256
  # How completions are drawn (greedy=True for one deterministic answer per task).
  sampling: SamplingConfig = SamplingConfig()
  # Seed of the generated suites' streams and of the sampler, the same at every evaluation, so checkpoints
  # are compared on the same tasks with the same random draws.
  seed: int = 0
  # Render the prompts of single-turn suites as a user turn of the tokenizer's chat template (multi-turn suites
  # always are: their replies are turns).
  chat: bool = False
  # How the `exact` suite matches answers: "math" (the stated answer or last number, symbolically equal) or "text"
  # (a word or phrase, normalised string equality with the answer or one of its aliases; `ptx.envs.exact_answer`).
  answer_match: Literal["math", "text"] = "math"
  # The reasoning_gym suite's families, "NAME" or "NAME:WEIGHT" (`ptx.envs.reasoning_gym`); empty: its default mix.
  families: tuple[str, ...] = ()
  # Evaluate every this many steps (None: train.checkpoint_every), after the last step, and before the first.
  every: int | None = None
  # Flag a suite whose pass@1 falls more than this below the run's starting value.
  regression: float = 0.05

  def __post_init__(self):
    for name in ("n", "k", "max_new_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"eval.{name} must be >= 1, got {getattr(self, name)}")
    if self.every is not None and self.every < 1:
      raise ValueError(f"eval.every must be >= 1 (or None: train.checkpoint_every), got {self.every}")
    if not 0 <= self.regression <= 1:
      raise ValueError(f"eval.regression must be in [0, 1] (a drop of pass@1), got {self.regression}")
    if self.answer_match not in ("math", "text"):
      raise ValueError(f"eval.answer_match must be 'math' or 'text', got {self.answer_match!r}")
    if len(set(self.suites)) != len(self.suites) or not all(self.suites):
      raise ValueError(f"eval.suites must be distinct, non-empty names, got {self.suites}")
    bad = [entry for entry in self.files if entry.count("=") != 1 or not all(entry.split("="))]
    if bad:
      raise ValueError(f"eval.files entries are 'suite=path', got {bad}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """How rollouts and evaluations sample: exactly or fast (`ptx.sampling.engine.mode`), and the engine's pool."""

  # "standard": the policy's float weights, one token per decode step. "fast": int8 weight-only copies of the
  # matrices, derived from the training weights once per update, and n-gram (prompt lookup) speculative decoding;
  # the loss rescoring with the float policy and its truncated importance weight absorb the int8 difference.
  mode: Literal["standard", "fast"] = "standard"
  # Fast mode: tokens drafted per sequence and verify at most.
  drafts: int = 4
  # Fast mode: a verify call's cost in decode steps; drafting runs only where the measured acceptance beats it
  # (1.5: an accelerator's estimate; a 2-core CPU measured 2.6, `calibrate` of benchmarks/fast_mode.py).
  verify_cost: float = 1.5
  # Fast mode: the longest context suffix the n-gram drafter looks up.
  max_ngram: int = 3
  # Fast mode: verify rounds per device call (the drafter runs on the device): one host round trip per up to
  # rounds x (drafts + 1) tokens a sequence.
  rounds: int = 4
  # K/V pages of the rollout engine, either mode: "auto" (the compute dtype) or "int8" (a float32 scale per slot
  # and head: about half of bfloat16's KV bytes; the sampler's log-probs are then the int8 cache's, so the loss
  # rescores them as fast mode does).
  kv_dtype: Literal["auto", "int8"] = "auto"
  # The engine's KV pages in its pool (0: every in-flight sequence at its worst case, which resumes exactly).
  pages: int = 0
  # Token positions per KV page.
  page_size: int = 16
  # Tokens per decode call; groups are scored and sequences admitted between calls.
  decode_steps: int = 16
  # Pages a sequence takes at admission. "reserve": its prompt and whole budget. "on_demand": its prompt and next
  # call, growing call by call, the last submitted preempted and recomputed when a rollout.pages pool runs out, so
  # rows that stop early fill the pool (`EngineConfig.admission`). With rollout.pages 0 nothing waits for pages and
  # either resumes exactly; in a smaller pool a resumed run may admit and preempt otherwise, so it reproduces to
  # float rounding (which can flip a near-tie token).
  admission: Literal["reserve", "on_demand"] = "reserve"

  def __post_init__(self):
    if self.pages < 0 or self.page_size < 1 or self.decode_steps < 1:
      raise ValueError(f"rollout.pages must be >= 0, rollout.page_size and rollout.decode_steps >= 1; got "
                       f"{self.pages}, {self.page_size} and {self.decode_steps}")
    if self.admission not in ("reserve", "on_demand"):
      raise ValueError(f"rollout.admission must be reserve or on_demand, got {self.admission!r}")
    if self.mode not in ("standard", "fast"):
      raise ValueError(f"rollout.mode must be standard or fast, got {self.mode!r}")
    if self.kv_dtype not in ("auto", "int8"):
      raise ValueError(f"rollout.kv_dtype must be auto or int8, got {self.kv_dtype!r}")
    if min(self.drafts, self.max_ngram, self.rounds) < 1 or self.verify_cost < 1.0:
      raise ValueError(f"rollout.drafts ({self.drafts}), rollout.max_ngram ({self.max_ngram}) and rollout.rounds "
                       f"({self.rounds}) must be >= 1, rollout.verify_cost ({self.verify_cost}) >= 1")


# The spec's presets (section 5.9), selectable as --grpo=NAME.
GRPO_PRESETS: dict[str, GRPOConfig] = {
    "grpo_paper": GRPOConfig(loss_agg_mode="seq_mean_token_mean", beta=0.04),
    "grpo": GRPOConfig(),
    "dapo": GRPOConfig(epsilon_high=0.28, kl_placement="none", beta=0.0, overlong_buffer=4096,
                       max_response_tokens=20480, filter_groups="refill"),
    "dr_grpo": GRPOConfig(advantage="grpo_no_std", loss_agg_mode="seq_mean_token_sum_norm", kl_placement="none",
                          beta=0.0),
    "gspo": GRPOConfig(surrogate="gspo", epsilon_low=3e-4, epsilon_high=4e-4, loss_agg_mode="seq_mean_token_mean",
                       kl_placement="none", beta=0.0),
    "rloo": GRPOConfig(advantage="rloo", kl_placement="reward", kl_estimator="k1"),
    "reinforce_pp_baseline": GRPOConfig(advantage="reinforce_pp_baseline"),
}


@dataclasses.dataclass(frozen=True)
class Config:
  """The whole configuration of a ptx job."""

  # The model architecture and numerics.
  model: ModelConfig = ModelConfig()
  # The device mesh.
  mesh: MeshConfig = MeshConfig()
  # The optimizer and its schedule.
  optim: OptimizerConfig = OptimizerConfig()
  # The training loop.
  train: TrainConfig = TrainConfig()
  # The data pipeline and batch shape.
  data: DataConfig = DataConfig()
  # Preference optimisation (ptx dpo).
  dpo: DPOConfig = DPOConfig()
  # Reinforcement learning with verifiable rewards (ptx grpo).
  grpo: GRPOConfig = GRPOConfig()
  # Low-rank adapters; rank 0 trains all parameters.
  lora: LoRAConfig = LoRAConfig()
  # Held-out suites evaluated at checkpoints, with regression flags.
  eval: EvalConfig = EvalConfig()
  # How rollouts and evaluations sample: standard or fast.
  rollout: RolloutConfig = RolloutConfig()


class ConfigError(ValueError):
  """A configuration override names an unknown field or has a bad value."""
