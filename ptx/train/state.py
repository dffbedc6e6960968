"""TrainState and its sharded initialisation."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ptx import sharding
from ptx.config import ModelConfig
from ptx.models import params as params_lib


@flax.struct.dataclass
class TrainState:
  """Everything a training step reads and writes; optimizers and configs are not leaves.

  Attributes:
    step: int32 scalar, the number of optimizer steps taken.
    params: the model parameter tree.
    opt_state: the optimizer state.
    rng: the root PRNG key; step N uses `fold_in(rng, N)`, so it never changes.
    ref_params: a frozen reference policy (DPO, GRPO with a KL term), laid
      out like `params`; None when the algorithm needs none.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  ref_params: Any = None


def state_shardings(model: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh,
                    rules: sharding.Rules = sharding.DEFAULT_RULES, *, with_reference: bool = False) -> TrainState:
  """A TrainState of NamedShardings: optimizer moments and the reference are laid out like the parameters."""
  replicated = NamedSharding(mesh, PartitionSpec())
  param_sh = params_lib.param_shardings(model, mesh, rules)
  abstract_opt = jax.eval_shape(optimizer.init, params_lib.abstract_params(model))
  opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, param_sh,
                                 transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                    ref_params=param_sh if with_reference else None)


def initial_params(model: ModelConfig, seed: int) -> Any:
  """The parameters `init_state` starts from for `seed` (unsharded), e.g. for a before/after evaluation."""
  init_key, _ = jax.random.split(jax.random.PRNGKey(seed))
  return jax.jit(params_lib.init_params, static_argnums=0)(model, init_key)


def init_state(model: ModelConfig, optimizer: optax.GradientTransformation, seed: int, mesh: Mesh,
               rules: sharding.Rules = sharding.DEFAULT_RULES, *, with_reference: bool = False,
               params: Any = None) -> TrainState:
  """Initialises parameters and optimizer state directly in their shardings.

  Args:
    model: the model config.
    optimizer: the optimizer whose state to create.
    seed: the root of the parameter init (when `params` is None) and of `rng`.
    mesh: the device mesh.
    rules: the sharding rules.
    with_reference: `ref_params` starts as a copy of the initial parameters.
    params: start from these parameters (e.g. an SFT result or loaded
      weights) instead of a fresh initialisation.
  """

  def init(key, params):
    init_key, rng = jax.random.split(key)
    if params is None:  # static: what initial_params(model, seed) returns
      params = params_lib.init_params(model, init_key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params), rng=rng,
                      ref_params=params if with_reference else None)

  out = state_shardings(model, optimizer, mesh, rules, with_reference=with_reference)
  return jax.jit(init, out_shardings=out)(jax.random.PRNGKey(seed), params)
