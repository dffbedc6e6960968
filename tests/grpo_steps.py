"""GRPO train steps as the tests build them: a fresh state on a mesh, and the fused, host-reward or engine step over it.

One helper for tests/train/grpo and the CLI option tests, so that steps of the same configuration are built the
same way (and compile to the same programs, which the run's compilation cache then serves once).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scripted_episodes import MODEL as TINY_MODEL
from stepping import run_steps
from tolerances import ADAM_EPS
from ptx.config import GRPOConfig, LoRAConfig, MeshConfig, OptimizerConfig
from ptx.model_config import ModelConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.lookahead import Lookahead
from ptx.data.tokenizer import ByteTokenizer
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.mode import RolloutMode
from ptx.sharding import make_mesh, rules_of
from ptx.train.grpo.engine import EngineRewardStep
from ptx.train.grpo.fused import FusedStep, make_grpo_step
from ptx.train.grpo.host import HostRewardStep
from ptx.train.grpo.prompts import PromptBatches
from ptx.train.grpo.samples import SampleLog
from ptx.train.grpo.update import RLSpec, coefficient_stage
from ptx.train.optimizer import make_optimizer
from ptx.train.state import TrainState, init_state, state_shardings

TOK = ByteTokenizer()
N_NEW = 6
# conftest's tiny_config with one layer, for module-scoped fixtures (a per-test fixture cannot feed them).
MODEL = dataclasses.replace(TINY_MODEL, n_layers=1)
MESH = MeshConfig(data=2, fsdp=4)


def even_tokens(gen, task):
  """A dense toy reward, in-graph: the fraction of generated tokens that are even."""
  live = jnp.arange(gen.tokens.shape[1])[None] < gen.lengths[:, None]
  return ((gen.tokens % 2 == 0) & live).sum(axis=1) / jnp.maximum(gen.lengths, 1)


def even_tokens_on_host(tokens, lengths, tasks):
  """`even_tokens` as Python on the host."""
  return np.asarray([np.mean(row[:n] % 2 == 0) if n else 0.0 for row, n in zip(tokens, lengths)], np.float32)


def prompt_batches(answer_width: int | None = 4) -> PromptBatches:
  """Arithmetic prompts, 8 a batch, left-padded to 8 tokens; in-graph targets `answer_width` wide, or (None) records."""
  return PromptBatches(ArithmeticTask(0, 2), TOK, batch_size=8, prompt_len=8, answer_width=answer_width)


def optimizer(grpo_cfg: GRPOConfig, eps: float = ADAM_EPS) -> optax.GradientTransformation:
  """AdamW at a constant lr 1e-3, then the coefficient stage when `grpo_cfg` adapts a coefficient.

  The tests compare the parameters of two programs after their updates: ADAM_EPS keeps Adam from amplifying their
  rounding (tolerances.py).
  """
  adamw = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0, eps=eps), 10)
  stage = coefficient_stage(grpo_cfg)
  return adamw if stage is None else optax.chain(adamw, stage)


@dataclasses.dataclass
class Built:
  """A GRPO step with its spec, mesh, optimizer, state shardings, current state and prompt stream."""

  step: Any
  spec: RLSpec
  state: TrainState
  data: Any
  mesh: jax.sharding.Mesh
  optimizer: optax.GradientTransformation
  shardings: TrainState

  def run(self, steps: int) -> tuple[TrainState, list[dict[str, Any]]]:
    """`steps` steps on the stream from the current state (kept: the step donates the one it is given)."""
    self.state, history = run_steps(self.step, self.state, self.data, steps)
    return self.state, history

  def checkpoint(self) -> dict[str, Any]:
    """What a checkpoint of the run holds now: a copy of the state, the pipeline as host arrays, the stream position."""
    return {"state": jax.tree.map(jnp.copy, self.state),
            "pipeline": jax.tree.map(np.asarray, self.step.pipeline_state()), "position": self.data.get_state()}


def build(cfg: ModelConfig, grpo_cfg: GRPOConfig, reward: Any, *, kind: str = "fused", lora: LoRAConfig | None = None,
          eps: float = ADAM_EPS, mesh_cfg: MeshConfig = MESH, engine: EngineConfig | None = None,
          mode: RolloutMode = RolloutMode(), stop_ids: tuple[int, ...] = (TOK.eos_id,), tokenizer: Any = None) -> Built:
  """The `kind` step of `grpo_cfg`: "fused" (`reward(gen, task)` in-graph), "host" or "engine" (`reward` on the host).

  The fused step reads `prompt_batches(4)`, the others `prompt_batches(None)` through a `Lookahead`; the mesh takes
  the first devices `mesh_cfg` needs. With a `tokenizer` the step keeps transcripts (`grpo.samples_every`; the fused
  step as `fit` runs it, `FusedStep`), decoded by it.
  """
  mesh = make_mesh(mesh_cfg, jax.devices()[:math.prod((mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.expert, mesh_cfg.tensor,
                                                       mesh_cfg.seq))])
  rules = rules_of(mesh_cfg)
  opt = optimizer(grpo_cfg, eps)
  with_ref = grpo_cfg.uses_reference
  shardings = state_shardings(cfg, opt, mesh, rules, with_reference=with_ref, lora=lora)
  state = init_state(cfg, opt, 0, mesh, rules, with_reference=with_ref, lora=lora)
  spec = RLSpec(model=cfg, grpo=grpo_cfg, max_new_tokens=N_NEW, stop_ids=stop_ids, pad_id=TOK.pad_id, lora=lora,
                rules=rules)
  common = dict(spec=spec, optimizer=opt, mesh=mesh, state_shardings=shardings, reward=reward)
  if kind == "fused":
    data = prompt_batches(4)
    samples = SampleLog(grpo_cfg, tokenizer)
    step = make_grpo_step(spec, reward, optimizer=opt, mesh=mesh, state_shardings=shardings, sample_rows=samples.rows)
    step = step if tokenizer is None else FusedStep(step, samples, grpo_cfg.group_size)
  elif kind == "host":
    data = Lookahead(prompt_batches(None))
    step = HostRewardStep(**common, prompts=data, tokenizer=tokenizer)
  else:
    data = Lookahead(prompt_batches(None))
    step = EngineRewardStep(**common, prompts=data, engine=engine, mode=mode, tokenizer=tokenizer)
  return Built(step=step, spec=spec, state=state, data=data, mesh=mesh, optimizer=opt, shardings=shardings)
