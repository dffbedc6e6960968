"""Draft models for speculative decoding, made by ptx itself: a cut of the policy, distilled on its own samples.

A `DraftModel` pays when it guesses the policy's next tokens. `cut` gives a
first guess at no cost: the policy's first layers with its embeddings and
final norm (the same tokenizer by construction). `distill` then trains it by
SFT on what the policy itself generates for a set of prompts: the rollout
engine samples `Distillation.samples` completions per prompt from the
policy's parameters, and the draft learns to predict their tokens (loss on
the completions only; the prompts are context), with the trainer's own step
(`ptx.train.step.make_train_step`, `ptx.algorithms.sft.loss`) on the given
mesh. Sample as the rollouts it will draft for do: at their temperature for
RL, greedily for greedy evaluation.

    draft_cfg, draft_params = cut(params, cfg, n_layers=2)
    draft_params, losses = distill(params, cfg, draft_cfg, draft_params, prompts, Distillation(steps=200), mesh)
    drafter = DraftModel(draft_params, draft_cfg)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ptx.algorithms import sft
from ptx.config import OptimizerConfig, SamplingConfig
from ptx.model_config import ModelConfig
from ptx.models.decoder import Params
from ptx.models.params import first_layers, trainable_mask, weight_decay_mask
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig
from ptx.sharding import batch_sharding
from ptx.train.optimizer import make_optimizer
from ptx.train.state import init_state, state_shardings
from ptx.train.step import make_train_step


def cut(params: Params, cfg: ModelConfig, n_layers: int) -> tuple[ModelConfig, Params]:
  """(config, parameters) of the policy's first `n_layers` layers, with its embeddings and final norm.

  Args:
    params: the policy's parameters (stacked layers).
    cfg: the policy's config.
    n_layers: layers to keep, 1 <= n_layers <= cfg.n_layers.

  Returns:
    The draft's config and parameters (its arrays slice the policy's).
  """
  if not 1 <= n_layers <= cfg.n_layers:
    raise ValueError(f"cut: n_layers must be in [1, {cfg.n_layers}] (the policy's layers), got {n_layers}")
  dense = tuple(i for i in cfg.moe.dense_layers if i < n_layers)
  draft = dataclasses.replace(cfg, n_layers=n_layers, moe=dataclasses.replace(cfg.moe, dense_layers=dense))
  return draft, first_layers(params, draft)


@dataclasses.dataclass(frozen=True)
class Distillation:
  """How `distill` samples the policy and trains the draft."""

  # Completions sampled per prompt.
  samples: int = 4
  # Tokens per completion (no stop ids: each runs to this budget, so every row is as long as its prompt allows).
  max_new_tokens: int = 64
  # How the policy samples them: as the rollouts the draft will serve do.
  sampling: SamplingConfig = SamplingConfig()
  # SFT steps, each on `batch_size` rows drawn without replacement (the rows reshuffled once all are used).
  steps: int = 200
  batch_size: int = 8
  optimizer: OptimizerConfig = OptimizerConfig(lr=1e-3, warmup_steps=10)
  seed: int = 0

  def __post_init__(self):
    for name in ("samples", "max_new_tokens", "steps", "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"Distillation.{name} must be >= 1, got {getattr(self, name)}")


def policy_rows(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], d: Distillation,
                page_size: int = 16) -> dict[str, np.ndarray]:
  """The policy's samples as an SFT batch of all rows: prompt + completion, the loss on the completion.

  Returns:
    int32 [N, W] `tokens`, `loss_mask`, `segment_ids` (0 past a row's end) and `positions`, N = prompts x samples.
  """
  if not prompts or any(not p for p in prompts):
    raise ValueError("distill: every prompt needs at least one token, and there must be prompts")
  longest = max(map(len, prompts)) + d.max_new_tokens
  rows = len(prompts) * d.samples
  config = EngineConfig.sized(rows, longest, page_size=page_size, prefill_chunk=max(map(len, prompts)),
                              prefill_rows=min(rows, 8))
  engine = RolloutEngine(cfg, config, sampling=d.sampling, seed=d.seed)
  ids = [(prompt, i) for prompt in prompts
         for i in engine.submit(list(prompt), max_new_tokens=d.max_new_tokens, samples=d.samples)]
  done = engine.run(params)
  width = -(-longest // 8) * 8
  batch = {name: np.zeros((rows, width), np.int32) for name in ("tokens", "loss_mask", "segment_ids", "positions")}
  for r, (prompt, i) in enumerate(ids):
    row = list(prompt) + done[i].tokens.tolist()
    batch["tokens"][r, :len(row)] = row
    batch["loss_mask"][r, len(prompt):len(row)] = 1
    batch["segment_ids"][r, :len(row)] = 1
    batch["positions"][r] = np.arange(width)
  return batch


def distill(params: Params, cfg: ModelConfig, draft_cfg: ModelConfig, draft_params: Params,
            prompts: Sequence[Sequence[int]], d: Distillation, mesh: Mesh) -> tuple[Params, list[float]]:
  """Trains `draft_params` by SFT on the policy's own samples of `prompts` (module docstring).

  Args:
    params: the policy's parameters.
    cfg: the policy's config.
    draft_cfg: the draft's config; its vocabulary must be the policy's.
    draft_params: where training starts (`cut`, or a fresh `init_params`).
    prompts: token ids to sample from; keep evaluation prompts out of them.
    d: sampling and training settings.
    mesh: the mesh the draft trains on (its batch axes must divide `d.batch_size`).

  Returns:
    (the trained draft's parameters, the loss of every step).
  """
  if draft_cfg.vocab_size != cfg.vocab_size:
    raise ValueError(f"distill: the draft's vocab_size ({draft_cfg.vocab_size}) must be the policy's "
                     f"({cfg.vocab_size}): a draft model shares the policy's tokenizer")
  rows = policy_rows(params, cfg, prompts, d)
  n = len(rows["tokens"])
  if d.batch_size > n:
    raise ValueError(f"Distillation.batch_size ({d.batch_size}) exceeds the {n} sampled rows (prompts x samples)")
  optimizer = make_optimizer(d.optimizer, d.steps, weight_decay_mask(draft_cfg), trainable_mask(draft_cfg))
  state = init_state(draft_cfg, optimizer, d.seed, mesh, params=draft_params)
  step = make_train_step(functools.partial(sft.loss, model=draft_cfg), optimizer, mesh=mesh,
                         state_shardings=state_shardings(draft_cfg, optimizer, mesh))
  placement, rng, order, losses = batch_sharding(mesh), np.random.default_rng(d.seed), np.empty(0, np.int64), []
  for _ in range(d.steps):
    if len(order) < d.batch_size:
      order = np.concatenate([order, rng.permutation(n)])
    pick, order = order[:d.batch_size], order[d.batch_size:]
    batch = {name: jax.device_put(x[pick], placement) for name, x in rows.items()}
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return state.params, losses
