"""LoRA: low-rank adapters as a transform of the parameter tree.

An adapted projection computes x W + (alpha / r) dropout(x) A B, W frozen.
The adapters are their own tree, `{target: {"a": A, "b": B}}` with targets
among q, k, v, o, gate, up, down; each is declared as a `ParamSpec` derived
from the weight it adapts (`adapter_specs`):

  A  [L, *in, r]   the weight's layer and input axes, then `lora_rank`
  B  [L, r, *out]  `lora_rank`, then the weight's output axes

so an adapter is sharded by the same rules as its weight, with the rank
replicated. A is drawn like PEFT's (Kaiming-uniform over its fan-in) and B is
zero, so a fresh adapter leaves the model exactly as it was.

`apply(base, adapters, cfg, rng)` returns the tree the decoder runs: each
target weight becomes a `LoRAWeight` (a pytree of W, A, B and a dropout key
per layer) that the layers' projections (`project`) apply factored, inside
the scanned layer. The base is referenced, never copied; the extra memory per
projection is the [B, T, r] activation x A, and nothing weight-sized is
formed, forward or backward, so gradients reach A and B only. `merge` folds
adapters into plain weights (W + (alpha / r) A B) for export or inference;
`unmerge` takes them out again.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ptx import sharding
from ptx.config import LoRAConfig
from ptx.model_config import ModelConfig
from ptx.models.dense import dense
from ptx.models.params import ParamSpec, Params, param_specs

# Leading (input) axes of each adaptable weight, after `layers`; the rest are outputs.
INPUT_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


@flax.struct.dataclass
class LoRAWeight:
  """A frozen weight W [L, *in, *out] with its adapter, applied as x W + scale dropout(x) A B.

  Attributes:
    w: the frozen weight.
    a: A [L, *in, r].
    b: B [L, r, *out].
    key: dropout PRNG keys, one per layer ([L] or [L, 2]); None: no dropout.
    scale: alpha / r.
    dropout: the dropout rate on the adapter's input.
  """

  w: jax.Array
  a: jax.Array
  b: jax.Array
  key: jax.Array | None
  scale: float = flax.struct.field(pytree_node=False)
  dropout: float = flax.struct.field(pytree_node=False)


def project(eq: str, x: jax.Array, w: jax.Array | LoRAWeight, dtype: Any) -> jax.Array:
  """`einsum(eq, x, w)` in `dtype` (as a 2-D `dense`); an adapted weight adds its low-rank term, factored.

  Args:
    eq: the projection, e.g. "btd,dhk->bthk"; the weight's contracted
      letters lead its subscripts.
    x: the activations.
    w: one layer's weight, or its `LoRAWeight`.
    dtype: the compute dtype.
  """
  if not isinstance(w, LoRAWeight):
    return dense(eq, x, w.astype(dtype))
  y = dense(eq, x, w.w.astype(dtype))
  inputs, out = eq.split("->")
  x_sub, w_sub = inputs.split(",")
  n_in = w.a.ndim - 1
  r = next(c for c in "rzyxwv" if c not in eq)
  h = x
  if w.key is not None and w.dropout > 0:
    keep = jax.random.bernoulli(w.key, 1.0 - w.dropout, x.shape)
    h = jnp.where(keep, x / (1.0 - w.dropout), 0).astype(x.dtype)
  xa_sub = "".join(c for c in x_sub if c not in w_sub[:n_in]) + r
  xa = jnp.einsum(f"{x_sub},{w_sub[:n_in]}{r}->{xa_sub}", h, w.a.astype(dtype))
  return y + w.scale * jnp.einsum(f"{xa_sub},{r}{w_sub[n_in:]}->{out}", xa, w.b.astype(dtype))


def adapter_specs(model: ModelConfig, cfg: LoRAConfig) -> Params:
  """`{target: {"a": ParamSpec, "b": ParamSpec}}`, derived from the specs of the adapted weights."""
  if cfg.rank <= 0:
    raise ValueError(f"lora.rank must be positive to build adapters, got {cfg.rank}")
  if model.moe.dense_layers:
    raise ValueError(f"lora: a Mixture of Experts with dense layers (model.moe.dense_layers="
                     f"{list(model.moe.dense_layers)}) takes no adapters yet; train it in full (lora.rank=0)")
  layers, r = param_specs(model)["layers"], cfg.rank
  absent = [name for name in cfg.targets if name not in layers]
  if absent:
    raise ValueError(f"lora.targets: {absent} are not weights of this model (its Mixture-of-Experts layers have no "
                     "dense MLP: experts take no adapters, shared experts are gate/up/down when moe.shared_mlp_dim "
                     f"> 0); its adaptable weights: {[name for name in INPUT_AXES if name in layers]}")
  specs = {}
  for name in cfg.targets:
    w, n = layers[name], 1 + INPUT_AXES[name]
    fan_in = math.prod(w.shape[1:n])
    specs[name] = {
        "a": ParamSpec(w.shape[:n] + (r,), w.logical_axes[:n] + ("lora_rank",), _kaiming_uniform(fan_in)),
        "b": ParamSpec((w.shape[0], r) + w.shape[n:], ("layers", "lora_rank") + w.logical_axes[n:],
                       jax.nn.initializers.zeros),
    }
  return specs


def init_adapters(model: ModelConfig, cfg: LoRAConfig, key: jax.Array) -> Params:
  """Fresh adapters in float32 (jit it to place them sharded).

  Adapters are float32 whatever the base's dtype: they are small, and their
  updates are too fine for a bfloat16 weight to hold.
  """
  specs = adapter_specs(model, cfg)
  leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [s.init(k, s.shape, jnp.float32) for s, k in zip(leaves, keys)])


def abstract_adapters(model: ModelConfig, cfg: LoRAConfig) -> Params:
  """The adapter tree as ShapeDtypeStructs; nothing is allocated."""
  return jax.eval_shape(lambda key: init_adapters(model, cfg, key), jax.random.key(0))


def adapter_shardings(model: ModelConfig, cfg: LoRAConfig, mesh: Mesh,
                      rules: sharding.Rules = sharding.DEFAULT_RULES) -> Params:
  """NamedSharding per adapter under the parameter rules, as its weight's (rank replicated)."""
  specs = adapter_specs(model, cfg)
  names = jax.tree.map(lambda s: s.logical_axes, specs, is_leaf=_is_spec)
  shapes = jax.tree.map(lambda s: s.shape, specs, is_leaf=_is_spec)
  return sharding.named_shardings(names, shapes, mesh, rules, kind="params")


def apply(base: Params, adapters: Params, cfg: LoRAConfig, rng: jax.Array | None = None) -> Params:
  """The parameter tree the decoder runs: `base` with each target weight wrapped in a `LoRAWeight`.

  Args:
    base: the frozen parameter tree (referenced, not copied).
    adapters: `{target: {"a", "b"}}` from `init_adapters` or training.
    cfg: the LoRA config (scale and dropout).
    rng: the step's key for adapter dropout; None (evaluation, sampling)
      applies no dropout.

  Returns:
    A parameter tree for `ptx.models.decoder.forward` (not for `Decoder`,
    which holds plain weights: use `merge` for that).
  """
  layers = dict(base["layers"])
  n_layers = next(iter(adapters.values()))["a"].shape[0]
  for i, name in enumerate(sorted(adapters)):
    key = None
    if rng is not None and cfg.dropout > 0:
      key = jax.random.split(jax.random.fold_in(rng, i), n_layers)
    layers[name] = LoRAWeight(layers[name], adapters[name]["a"], adapters[name]["b"], key,
                              scale=cfg.alpha / cfg.rank, dropout=cfg.dropout)
  return {**base, "layers": layers}


def delta(adapter: Params, cfg: LoRAConfig) -> jax.Array:
  """The float32 weight update (alpha / r) A B [L, *in, *out] of one adapter."""
  a, b = adapter["a"].astype(jnp.float32), adapter["b"].astype(jnp.float32)
  letters = "abcdefgh"
  ins, outs = letters[:a.ndim - 2], letters[a.ndim - 2:a.ndim + b.ndim - 4]
  return (cfg.alpha / cfg.rank) * jnp.einsum(f"l{ins}r,lr{outs}->l{ins}{outs}", a, b)


def merge(base: Params, adapters: Params, cfg: LoRAConfig) -> Params:
  """Plain parameters with the adapters folded in: W + (alpha / r) A B per target, in W's dtype."""
  layers = dict(base["layers"])
  for name, adapter in adapters.items():
    w = layers[name]
    layers[name] = (w.astype(jnp.float32) + delta(adapter, cfg)).astype(w.dtype)
  return {**base, "layers": layers}


def unmerge(merged: Params, adapters: Params, cfg: LoRAConfig) -> Params:
  """The base back from merged parameters: W - (alpha / r) A B per target (exact up to rounding)."""
  layers = dict(merged["layers"])
  for name, adapter in adapters.items():
    w = layers[name]
    layers[name] = (w.astype(jnp.float32) - delta(adapter, cfg)).astype(w.dtype)
  return {**merged, "layers": layers}


def _kaiming_uniform(fan_in: int):
  """PEFT's (and torch Linear's) default for A: uniform on +-1/sqrt(fan_in)."""
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def _is_spec(x: Any) -> bool:
  return isinstance(x, ParamSpec)
