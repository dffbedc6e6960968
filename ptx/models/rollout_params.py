"""Rollout parameters: the policy's matrices in int8 for the sampling programs, derived once per policy update.

`rollout_params(params, cfg)` returns the tree the rollout engine samples
from: each layer projection (q, k, v, o, gate, up, down) and the output
projection become int8 `QArray`s, one float32 scale per output channel
(`ptx.models.int8_weights.quantize`); norms and biases are referenced as they
are, and so are a Mixture-of-Experts layer's router and experts (the grouped
matmuls read float weights). Nothing is written into `params`: training keeps its float arrays, and
the loss scores the rollouts with them (GRPO's recomputed old log-probs and
truncated importance weights absorb the sampler's difference).

Embeddings: a tied table [V, D] is quantised per vocabulary row, which is
per output channel of the unembedding it also is (and the lookup dequantises
the few rows it reads). An untied input table stays float: a step reads one
row per token, so int8 would save memory but no time, and the inputs stay exact.

`rollout_shardings` places the tree like the training parameters: an int8
weight where its float one lives, its scale on the same logical axes (the
contracted ones, of size 1, replicated).
"""

from __future__ import annotations

import functools

import jax
import qwix
from jax.sharding import Mesh

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models import int8_weights, lora
from ptx.models import params as params_lib
from ptx.models.params import Params


def rollout_params(params: Params, cfg: ModelConfig) -> Params:
  """The int8 rollout tree of plain training `params` (module docstring); jit it with `rollout_shardings`.

  Args:
    params: the training parameters of `ptx.models.params.param_specs(cfg)`,
      stacked layers; fold LoRA adapters in first (`ptx.models.lora.merge`).
    cfg: the model config.

  Returns:
    A tree of the same structure whose projections are `QArray`s.

  Raises:
    TypeError: when a projection is not a plain array (an applied adapter, or already int8).
  """
  out = dict(params)
  for stack in params_lib.STACKS:
    if stack not in params:
      continue
    layers = out[stack] = dict(params[stack])
    for name, n_in in lora.INPUT_AXES.items():
      if name not in layers:  # an MoE layer without shared experts has no dense MLP
        continue
      if isinstance(layers[name], (lora.LoRAWeight, qwix.QArray)):
        raise TypeError(f"rollout_params: params[{stack!r}][{name!r}] is a {type(layers[name]).__name__}, not a "
                        "float array; pass the training parameters, LoRA adapters merged (ptx.models.lora.merge)")
      layers[name] = int8_weights.quantize(layers[name], contracted=range(1, 1 + n_in))  # after the layers axis
  if cfg.tie_embeddings:
    out["embed"] = int8_weights.quantize(params["embed"], contracted=(1,))  # [V, D]: the unembedding contracts D
  else:
    out["lm_head"] = int8_weights.quantize(params["lm_head"], contracted=(0,))  # [D, V]
  return out


def abstract_rollout_params(cfg: ModelConfig) -> Params:
  """The rollout tree as ShapeDtypeStructs; nothing is allocated."""
  return jax.eval_shape(functools.partial(rollout_params, cfg=cfg), params_lib.abstract_params(cfg))


def rollout_shardings(cfg: ModelConfig, mesh: Mesh, rules: sharding.Rules = sharding.DEFAULT_RULES) -> Params:
  """NamedSharding per rollout array under the parameter rules: a QArray's qvalue and scale on its weight's axes."""
  abstract = abstract_rollout_params(cfg)
  # Every array of a weight's subtree (the weight, or a QArray's qvalue and scale) takes the weight's logical axes.
  names = jax.tree.map(lambda axes, arrays: jax.tree.map(lambda _: axes, arrays), params_lib.logical_axes(cfg),
                       abstract, is_leaf=lambda x: isinstance(x, tuple))
  return sharding.named_shardings(names, abstract, mesh, rules, kind="params")
