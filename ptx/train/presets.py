"""Hyperparameter presets: toy runs of a fresh tiny model, and fine-tuning of a real one.

Two families, never mixed:
  TOY       a fresh `tiny` model (byte tokenizer): learning rates and shapes
            sized for a 2-layer model that learns short records from scratch
            in minutes on a CPU (GRPO: the built-in 2-digit addition task).
  FINETUNE  pretrained weights (`--model-dir`): learning rates, batch and
            sequence shapes of common practice for instruct models (TRL's and
            the GRPO/DPO papers' ranges); the architecture comes from the
            checkpoint, and the preset's execution settings (remat,
            attention, logits chunk, dtypes) are kept. They recompute every
            layer's activations in the backward pass (`remat="full"`), and
            GRPO's update runs in 2 micro-batches, so SmolLM2-135M trains in
            a 24 GB host (XLA's estimates before the first step: SFT 6.5 GB,
            7.6 GB peak RSS measured; DPO 9.9 GB; GRPO 11.5 GB; without
            them 51, 91 and 174 GB).

Every entry point (the CLI, the demo, recipes, notebooks) starts from one of
these, so `ptx grpo` and `ptx demo` train the same GRPO stage.

The built-in task: problem i of `ArithmeticTask(seed, DIGITS, split=...)`;
seed `SFT_SEED` gives the toy SFT records and `GRPO_SEED` the GRPO prompts,
both from the train side of the split (`ptx.data.splits`), and
`HELD_OUT_SEED` the held-out problems, from the other side.
"""

from __future__ import annotations

from typing import Callable

from ptx.config import Config, DataConfig, DPOConfig, GRPOConfig, OptimizerConfig, TrainConfig
from ptx.model_config import MODEL_PRESETS, ModelConfig

DIGITS = 2
SFT_SEED, GRPO_SEED, HELD_OUT_SEED = 0, 2, 1
# "99+99=" after bos fits 8 tokens; "198" then eos fits 4.
PROMPT_LEN, ANSWER_WIDTH = 8, 4


# The toy GRPO stage: 8 samples per prompt, no KL (the demo trains the SFT result on).
_TOY_GRPO = GRPOConfig(group_size=8, kl_placement="none", beta=0.0, max_response_tokens=ANSWER_WIDTH)


def _toy_sft() -> Config:
  return Config(
      model=MODEL_PRESETS["tiny"](),
      optim=OptimizerConfig(lr=3e-3, warmup_steps=20, weight_decay=0.01),
      train=TrainConfig(steps=600, log_every=50, checkpoint_every=200, eval_every=200),
      data=DataConfig(batch_size=16, seq_len=256), grpo=_TOY_GRPO)


def _toy_dpo() -> Config:
  return Config(
      model=MODEL_PRESETS["tiny"](),
      optim=OptimizerConfig(lr=1e-3, warmup_steps=5),
      train=TrainConfig(steps=60, log_every=10, eval_every=30, checkpoint_every=30),
      data=DataConfig(kind="preference", batch_size=16, seq_len=128, pack=False),
      dpo=DPOConfig(beta=0.1))


def _toy_grpo() -> Config:
  # 128 prompts a step at lr 3e-4 decayed to 0: the demo's GRPO stage (sweep in benchmarks/RESULTS.md).
  return Config(
      model=MODEL_PRESETS["tiny"](),
      optim=OptimizerConfig(lr=3e-4, warmup_steps=5, min_lr_ratio=0.0, weight_decay=0.0),
      train=TrainConfig(steps=400, log_every=10, checkpoint_every=50, eval_every=10**9),
      data=DataConfig(kind="rl", batch_size=128, seq_len=PROMPT_LEN, pack=False), grpo=_TOY_GRPO)


# The fine-tuning presets' execution settings: the checkpoint gives the architecture.
_FINETUNE_MODEL = ModelConfig(remat="full")


def _finetune_sft() -> Config:
  return Config(
      model=_FINETUNE_MODEL,
      optim=OptimizerConfig(lr=2e-5, warmup_steps=20, min_lr_ratio=0.1, weight_decay=0.0),
      train=TrainConfig(steps=300, log_every=10, eval_every=100, checkpoint_every=100),
      data=DataConfig(batch_size=16, seq_len=2048))


def _finetune_dpo() -> Config:
  return Config(
      model=_FINETUNE_MODEL,
      optim=OptimizerConfig(lr=5e-7, warmup_steps=20, min_lr_ratio=0.1, weight_decay=0.0),
      train=TrainConfig(steps=300, log_every=10, eval_every=100, checkpoint_every=100),
      data=DataConfig(kind="preference", batch_size=16, seq_len=1024, pack=False),
      dpo=DPOConfig(beta=0.1))


def _finetune_grpo() -> Config:
  return Config(
      model=_FINETUNE_MODEL,
      optim=OptimizerConfig(lr=1e-6, warmup_steps=10, min_lr_ratio=1.0, weight_decay=0.0),
      train=TrainConfig(steps=200, log_every=1, checkpoint_every=25, eval_every=10**9, grad_accum=2),
      data=DataConfig(kind="rl", batch_size=16, seq_len=512, pack=False),
      grpo=GRPOConfig(group_size=8, max_response_tokens=256, kl_placement="none", beta=0.0))


TOY: dict[str, Callable[[], Config]] = {"sft": _toy_sft, "dpo": _toy_dpo, "grpo": _toy_grpo}
FINETUNE: dict[str, Callable[[], Config]] = {"sft": _finetune_sft, "dpo": _finetune_dpo, "grpo": _finetune_grpo}

