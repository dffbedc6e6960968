"""Rollout modes: the engine and the parameter tree a sampler uses, standard or fast, built once from `rollout`.

`RolloutMode.of(cfg.rollout)` reads the config section (`ptx.config.RolloutConfig`)
in one place; what it returns is finished objects for the samplers: GRPO's
engine rollouts (`ptx.train.grpo.engine`) and evaluations
(`ptx.train.checkpoint_evals`, `ptx eval`) never look at the section again.

- standard: a `RolloutEngine` sampling from the policy's own arrays; its
  log-probs are the policy's to float32 rounding.
- fast: a `SpeculativeEngine` with the n-gram drafter (prompt lookup: no
  extra model), sampling from `ptx.models.rollout_params`' int8 weight-only
  tree, derived from the policy's arrays once per policy update and placed
  like them. With a host drafter the engine emits the tokens the standard
  engine samples from the same tree and seed, so speculation changes speed,
  never tokens; int8 changes the distribution slightly, so the sampler's
  log-probs are not the policy's (`exact` is False): GRPO recomputes the
  policy's log-probs and weights the loss by the truncated importance ratio.
- either, with `rollout.kv_dtype="int8"`: the engine's K/V pages in int8
  (`EngineConfig.kv_dtype`), about half of bfloat16's KV bytes; not exact
  either, so the loss rescores as in fast mode.

What "fast" saves depends on the backend: TPU and GPU fuse the int8 read
into the matmul, XLA:CPU materialises the dequantised weight (0.94x float's
decode speed); a verify call costs `verify_cost` decode steps, which the
engine's cost model weighs against each sequence's measured acceptance.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
from jax.sharding import Mesh

from ptx import sharding
from ptx.config import RolloutConfig
from ptx.model_config import ModelConfig
from ptx.models.params import Params
from ptx.models.rollout_params import rollout_params, rollout_shardings
from ptx.sampling.engine.drafters import NgramDrafter
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.speculative import SpeculativeConfig, SpeculativeEngine


@dataclasses.dataclass(frozen=True)
class RolloutMode:
  """How a sampler draws: its engine (plain or speculative) and its parameter tree (the policy's, or int8).

  Attributes:
    speculative: the speculative engine's settings; None for the plain engine.
    drafter: the n-gram drafter of the speculative engine.
    int8: sample from `rollout_params`' int8 tree instead of the policy's arrays.
    kv_int8: keep the engine's K/V pages in int8 (`EngineConfig.kv_dtype`).
  """

  speculative: SpeculativeConfig | None = None
  drafter: NgramDrafter = NgramDrafter()
  int8: bool = False
  kv_int8: bool = False

  @classmethod
  def of(cls, cfg: RolloutConfig) -> "RolloutMode":
    """The mode of a `rollout` config section: standard, or fast (int8 and n-gram speculation); int8 pages in
    either with `rollout.kv_dtype=int8`."""
    kv_int8 = cfg.kv_dtype == "int8"
    if cfg.mode == "standard":
      return cls(kv_int8=kv_int8)
    return cls(speculative=SpeculativeConfig(drafts=cfg.drafts, verify_cost=cfg.verify_cost, rounds=cfg.rounds),
               drafter=NgramDrafter(max_ngram=cfg.max_ngram), int8=True, kv_int8=kv_int8)

  @property
  def standard(self) -> bool:
    """Whether this is the standard mode: the policy's arrays on the plain engine."""
    return self == RolloutMode()

  @property
  def exact(self) -> bool:
    """Whether the sampler's log-probs are the policy's (to float32 rounding): no importance correction needed."""
    return not (self.int8 or self.kv_int8)

  def engine(self, model: ModelConfig, config: EngineConfig, **engine_args) -> RolloutEngine:
    """The mode's engine over `config`'s shapes (`RolloutEngine`'s keyword arguments: sampling, seed, mesh, ...)."""
    if self.kv_int8:
      config = dataclasses.replace(config, kv_dtype="int8")
    if self.speculative is None:
      return RolloutEngine(model, config, **engine_args)
    return SpeculativeEngine(model, config, drafter=self.drafter, speculative=self.speculative, **engine_args)

  def params_fn(self, model: ModelConfig, mesh: Mesh | None,
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> Callable[[Params], Params]:
    """`policy params -> the tree the engine samples from`: the identity, or one jitted int8 derivation per call.

    Args:
      model: the model config.
      mesh: where the policy's arrays live; the int8 tree is placed like them
        (None: one device).
      rules: the sharding rules the policy's arrays were placed by.

    Returns:
      The function; call it once per policy update, outside the decode loop.
      It takes plain parameters (LoRA adapters merged).
    """
    if not self.int8:
      return lambda params: params
    derive = functools.partial(rollout_params, cfg=model)
    if mesh is None:
      return jax.jit(derive)
    return jax.jit(derive, out_shardings=rollout_shardings(model, mesh, rules))
