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
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


def state_shardings(model: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh,
                    rules: sharding.Rules = sharding.DEFAULT_RULES) -> TrainState:
  """A TrainState of NamedShardings: optimizer moments are laid out like their parameters."""
  replicated = NamedSharding(mesh, PartitionSpec())
  param_sh = params_lib.param_shardings(model, mesh, rules)
  abstract_opt = jax.eval_shape(optimizer.init, params_lib.abstract_params(model))
  opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, param_sh,
                                 transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated)


def init_state(model: ModelConfig, optimizer: optax.GradientTransformation, seed: int, mesh: Mesh,
               rules: sharding.Rules = sharding.DEFAULT_RULES) -> TrainState:
  """Initialises parameters and optimizer state directly in their shardings."""

  def init(key):
    init_key, rng = jax.random.split(key)
    params = params_lib.init_params(model, init_key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params), rng=rng)

  out = state_shardings(model, optimizer, mesh, rules)
  return jax.jit(init, out_shardings=out)(jax.random.PRNGKey(seed))

