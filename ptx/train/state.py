"""TrainState and its sharded initialisation."""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ptx import sharding
from ptx.config import LoRAConfig
from ptx.model_config import ModelConfig
from ptx.models import lora as lora_lib
from ptx.models import params as params_lib


@flax.struct.dataclass
class TrainState:
  """Everything a training step reads and writes; optimizers and configs are not leaves.

  Attributes:
    step: int32 scalar, the number of optimizer steps taken.
    params: the trained parameters: the model parameter tree, or under LoRA
      the adapters (`ptx.models.lora`), the only leaves the optimizer sees.
    opt_state: the optimizer state.
    rng: the root PRNG key; step N uses `fold_in(rng, N)`, so it never changes.
    ref_params: a frozen reference policy (DPO, GRPO with a KL term), laid
      out like `params`; None when the algorithm needs none, and under LoRA,
      whose reference is `base`.
    base: under LoRA, the frozen model parameters the adapters apply to,
      held once (the donated step hands the same buffers back); else None.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  ref_params: Any = None
  base: Any = None


def state_shardings(model: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh,
                    rules: sharding.Rules = sharding.DEFAULT_RULES, *, with_reference: bool = False,
                    lora: LoRAConfig | None = None) -> TrainState:
  """A TrainState of NamedShardings: optimizer moments and the reference are laid out like the parameters.

  With `lora`, `params` and the moments are the adapters' and `base` is laid
  out like the model; `with_reference` then adds nothing (the base is the
  reference).
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  model_sh = params_lib.param_shardings(model, mesh, rules)
  if lora is None:
    param_sh, abstract = model_sh, params_lib.abstract_params(model)
  else:
    param_sh, abstract = lora_lib.adapter_shardings(model, lora, mesh, rules), lora_lib.abstract_adapters(model, lora)
  abstract_opt = jax.eval_shape(optimizer.init, abstract)
  opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, param_sh,
                                 transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                    ref_params=model_sh if with_reference and lora is None else None,
                    base=None if lora is None else model_sh)


def abstract_state(shardings: TrainState, init: Callable[[], TrainState]) -> TrainState:
  """The state `init()` would build, as ShapeDtypeStructs carrying `shardings`: nothing is allocated."""
  return jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shardings,
                      jax.eval_shape(init))


def initial_params(model: ModelConfig, seed: int) -> Any:
  """The parameters `init_state` starts from for `seed` (unsharded), e.g. for a before/after evaluation."""
  init_key, _ = jax.random.split(jax.random.PRNGKey(seed))
  return jax.jit(params_lib.init_params, static_argnums=0)(model, init_key)


def init_state(model: ModelConfig, optimizer: optax.GradientTransformation, seed: int, mesh: Mesh,
               rules: sharding.Rules = sharding.DEFAULT_RULES, *, with_reference: bool = False,
               params: Any = None, lora: LoRAConfig | None = None) -> TrainState:
  """Initialises parameters and optimizer state directly in their shardings.

  Args:
    model: the model config.
    optimizer: the optimizer whose state to create.
    seed: the root of the parameter init (when `params` is None) and of `rng`.
    mesh: the device mesh.
    rules: the sharding rules.
    with_reference: `ref_params` starts as a copy of the initial parameters
      (not under LoRA, whose reference is the base).
    params: start from these parameters (e.g. an SFT result or loaded
      weights) instead of a fresh initialisation; under LoRA, the frozen base,
      placed without a copy and so donated with the state by the train step.
    lora: train fresh adapters of this config over the frozen model
      (`TrainState.base`) instead of the model's parameters.
  """
  if params is not None:  # otherwise a 30-layer tree would train under a 2-layer config, which exports 2
    params_lib.check_params(model, params, "init_params")
  out = state_shardings(model, optimizer, mesh, rules, with_reference=with_reference, lora=lora)
  if lora is not None:
    return _init_lora_state(model, optimizer, seed, lora, out, params)

  def init(key, params):
    init_key, rng = jax.random.split(key)
    if params is None:  # static: what initial_params(model, seed) returns
      params = params_lib.init_params(model, init_key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params), rng=rng,
                      ref_params=params if with_reference else None)

  return jax.jit(init, out_shardings=out)(jax.random.PRNGKey(seed), params)


def _init_lora_state(model: ModelConfig, optimizer: optax.GradientTransformation, seed: int, lora: LoRAConfig,
                     out: TrainState, base: Any) -> TrainState:
  """Fresh adapters and their optimizer state over `base`, or over `initial_params(model, seed)`."""

  def init(key):
    init_key, rng = jax.random.split(key)
    adapters = lora_lib.init_adapters(model, lora, jax.random.fold_in(init_key, 1))
    return TrainState(step=jnp.zeros((), jnp.int32), params=adapters, opt_state=optimizer.init(adapters), rng=rng,
                      base=params_lib.init_params(model, init_key) if base is None else None)

  if base is None:
    return jax.jit(init, out_shardings=out)(jax.random.PRNGKey(seed))
  # A given base stays out of the jit, whose outputs would be copies of it: placed, not copied.
  state = jax.jit(init, out_shardings=out.replace(base=None))(jax.random.PRNGKey(seed))
  return state.replace(base=jax.device_put(base, out.base))
