"""Every decoder parameter declared once: shape, logical axes, initializer.

`param_specs(cfg)` is the single source for a weight's shape and layout; it
feeds initialisation, shardings, `jax.eval_shape`, checkpoint-restore targets
and parameter counts. Per-layer weights carry a leading `layers` axis and are
run with a scan.

Tree (L layers, D d_model, H heads, N kv heads, K head_dim, F mlp, V vocab):
  embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied)
  layers: attn_norm [L, D]; q [L, D, H, K]; k, v [L, D, N, K]; o [L, H, K, D];
          mlp_norm [L, D]; gate, up [L, D, F]; down [L, F, D]
          + q_bias [L, H, K], k_bias, v_bias [L, N, K]   (qkv_bias)
          + o_bias [L, D]                                 (o_bias)
          + sinks [L, H]                                  (attention_sinks)
          + q_norm, k_norm [L, K]                         (qk_norm)
          + attn_post_norm, mlp_post_norm [L, D]          (post_norms)
  Mixture-of-Experts layers (moe.n_experts E > 0, F' moe.expert_mlp_dim, ptx.models.moe) replace gate, up and
  down with router [L, D, E]; expert_gate, expert_up [L, E, D, F']; expert_down [L, E, F', D]
          + router_bias [L, E]                            (moe.router_bias)
          + expert_gate_bias, expert_up_bias [L, E, F']; expert_down_bias [L, E, D]   (moe.expert_bias)
          + router_correction [L, E], not trainable       (moe.router "sigmoid")
          + gate, up [L, D, S]; down [L, S, D]            (the shared experts, S moe.shared_mlp_dim > 0)
  Multi-head latent attention layers (mla.kv_lora_rank C > 0, Q mla.q_lora_rank, Kn mla.qk_nope_head_dim, K
  head_dim the rotary width, Kv mla.v_head_dim) replace q, k, v and o with
          q_a [L, D, Q]; q_a_norm [L, Q]; q_b [L, Q, H, Kn + K]  (Q > 0; else q [L, D, H, Kn + K])
          kv_a [L, D, C + K]; kv_a_norm [L, C]; kv_b [L, C, H, Kn + Kv]; o [L, H, Kv, D]
  (a latent's rank is sharded like `embed` where it is a weight's input, and not sharded where it is its output)
  dense_layers: the layers of `moe.dense_layers` in a Mixture of Experts, with the dense MLP's weights: a stack
          of its own, run in its layers' places (`ModelConfig.stack_layers`); `layers` then holds the MoE layers.
  A vision tower (vision.depth Lv > 0, `ptx.models.vision`; Dv vision.width, Hv heads of Kv = Dv / Hv, Fv
  vision.mlp_dim, Np patches, Pd = channels x patch_size^2, s vision.scale_factor) adds, on the text model's axes
  (its width is `embed`), not trainable unless vision.train_tower / train_connector:
  vision: patch [Pd, Dv]; patch_bias [Dv]; pos [Np, Dv]; post_norm, post_norm_bias [Dv]
          attn_norm, attn_norm_bias [Lv, Dv]; q [Lv, Dv, Hv, Kv]; k, v [Lv, Dv, Hv, Kv] (kv_heads); o [Lv, Hv, Kv, Dv]
          q_bias, k_bias, v_bias [Lv, Hv, Kv]; o_bias [Lv, Dv]; mlp_norm, mlp_norm_bias [Lv, Dv]
          up [Lv, Dv, Fv]; up_bias [Lv, Fv]; down [Lv, Fv, Dv]; down_bias [Lv, Dv]
  connector: proj [s^2 Dv, D]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ptx import sharding
from ptx.model_config import ModelConfig

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]
Params = dict[str, Any]
# The subtrees that hold stacked layers: every layer, or a Mixture of Experts' MoE layers; and a Mixture of
# Experts' dense layers (`moe.dense_layers`). `ModelConfig.stack_layers` says which layers each holds.
STACKS = ("layers", "dense_layers")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  """The declaration of one parameter array."""

  shape: tuple[int, ...]
  logical_axes: tuple[str | None, ...]
  init: Initializer
  # False: saved, loaded and sharded like any parameter, never changed by the optimizer (nor decayed, nor adapted).
  trainable: bool = True

  def __post_init__(self):
    if len(self.shape) != len(self.logical_axes):
      raise ValueError(f"ParamSpec: shape {self.shape} vs logical axes {self.logical_axes}")


def param_specs(cfg: ModelConfig) -> Params:
  """Returns the nested dict of ParamSpec for a decoder config."""
  D, V = cfg.d_model, cfg.vocab_size
  if cfg.n_heads % cfg.n_kv_heads:
    raise ValueError(f"model.n_heads={cfg.n_heads} must be a multiple of model.n_kv_heads={cfg.n_kv_heads}")
  weight, _, norm = _initializers(cfg)
  specs = {
      "embed": ParamSpec((V, D), ("vocab", "embed"), weight),
      "layers": _layer_specs(cfg, len(cfg.stack_layers("layers")), moe_mlp=cfg.moe.enabled),
      "final_norm": ParamSpec((D,), ("embed",), norm),
  }
  if cfg.moe.dense_layers:
    specs["dense_layers"] = _layer_specs(cfg, len(cfg.moe.dense_layers), moe_mlp=False)
  if not cfg.tie_embeddings:
    specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), weight)
  if cfg.vision.enabled:
    specs["vision"] = _vision_specs(cfg)
    specs["connector"] = {"proj": ParamSpec((cfg.vision.scale_factor ** 2 * cfg.vision.width, D), (None, "embed"),
                                            weight, trainable=cfg.vision.train_connector)}
  return specs


def _layer_specs(cfg: ModelConfig, L: int, *, moe_mlp: bool) -> dict[str, ParamSpec]:
  """The ParamSpecs of a stack of L layers, whose MLPs are Mixtures of Experts (`moe_mlp`) or dense."""
  D, H, N, K, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
  weight, zeros, norm = _initializers(cfg)

  def layer(shape, axes, init=weight):
    return ParamSpec((L,) + shape, ("layers",) + axes, init)

  layers = {"attn_norm": layer((D,), ("embed",), norm)}
  if cfg.mla.enabled:
    layers.update(_mla_specs(cfg, layer, norm))
  else:
    layers.update({
        "q": layer((D, H, K), ("embed", "heads", "head_dim")),
        "k": layer((D, N, K), ("embed", "kv_heads", "head_dim")),
        "v": layer((D, N, K), ("embed", "kv_heads", "head_dim")),
        "o": layer((H, K, D), ("heads", "head_dim", "embed")),
    })
  layers["mlp_norm"] = layer((D,), ("embed",), norm)
  moe = cfg.moe
  if moe_mlp:
    E, F = moe.n_experts, moe.expert_mlp_dim
    layers["router"] = layer((D, E), ("embed", None))
    if moe.router_bias:
      layers["router_bias"] = layer((E,), (None,), zeros)
    if moe.router == "sigmoid":  # chooses experts, never weights them; balanced by a rule, not by gradients
      layers["router_correction"] = ParamSpec((L, E), ("layers", None), zeros, trainable=False)
    layers["expert_gate"] = layer((E, D, F), ("experts", "embed", "mlp"))
    layers["expert_up"] = layer((E, D, F), ("experts", "embed", "mlp"))
    layers["expert_down"] = layer((E, F, D), ("experts", "mlp", "embed"))
    if moe.expert_bias:
      layers["expert_gate_bias"] = layer((E, F), ("experts", "mlp"), zeros)
      layers["expert_up_bias"] = layer((E, F), ("experts", "mlp"), zeros)
      layers["expert_down_bias"] = layer((E, D), ("experts", "embed"), zeros)
  if not moe_mlp or moe.shared_mlp_dim:
    S = moe.shared_mlp_dim if moe_mlp else F
    layers["gate"] = layer((D, S), ("embed", "mlp"))
    layers["up"] = layer((D, S), ("embed", "mlp"))
    layers["down"] = layer((S, D), ("mlp", "embed"))
  if cfg.qkv_bias:
    layers["q_bias"] = layer((H, K), ("heads", "head_dim"), zeros)
    layers["k_bias"] = layer((N, K), ("kv_heads", "head_dim"), zeros)
    layers["v_bias"] = layer((N, K), ("kv_heads", "head_dim"), zeros)
  if cfg.o_bias:
    layers["o_bias"] = layer((D,), ("embed",), zeros)
  if cfg.attention_sinks:  # a sink of logit 0 at first; HF draws them like weights, but trained ones are O(1)
    layers["sinks"] = layer((H,), ("heads",), zeros)
  if cfg.qk_norm:
    layers["q_norm"] = layer((K,), ("head_dim",), norm)
    layers["k_norm"] = layer((K,), ("head_dim",), norm)
  if cfg.post_norms:
    layers["attn_post_norm"] = layer((D,), ("embed",), norm)
    layers["mlp_post_norm"] = layer((D,), ("embed",), norm)
  return layers


def _vision_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
  """The vision tower's ParamSpecs: embeddings, final norm, and its encoder layers stacked on `layers`."""
  vc = cfg.vision
  L, D, H, F = vc.depth, vc.width, vc.n_heads, vc.mlp_dim
  K = D // H
  weight = jax.nn.initializers.normal(cfg.init_std)
  zeros, ones = jax.nn.initializers.zeros, jax.nn.initializers.ones

  def spec(shape, axes, init=weight):
    return ParamSpec(shape, axes, init, trainable=vc.train_tower)

  def layer(shape, axes, init=weight):
    return spec((L,) + shape, ("layers",) + axes, init)

  return {
      "patch": spec((vc.patch_dim, D), (None, "embed")),
      "patch_bias": spec((D,), ("embed",), zeros),
      "pos": spec((vc.n_patches, D), (None, "embed")),
      "attn_norm": layer((D,), ("embed",), ones),
      "attn_norm_bias": layer((D,), ("embed",), zeros),
      "q": layer((D, H, K), ("embed", "heads", "head_dim")),
      "k": layer((D, H, K), ("embed", "kv_heads", "head_dim")),
      "v": layer((D, H, K), ("embed", "kv_heads", "head_dim")),
      "o": layer((H, K, D), ("heads", "head_dim", "embed")),
      "q_bias": layer((H, K), ("heads", "head_dim"), zeros),
      "k_bias": layer((H, K), ("kv_heads", "head_dim"), zeros),
      "v_bias": layer((H, K), ("kv_heads", "head_dim"), zeros),
      "o_bias": layer((D,), ("embed",), zeros),
      "mlp_norm": layer((D,), ("embed",), ones),
      "mlp_norm_bias": layer((D,), ("embed",), zeros),
      "up": layer((D, F), ("embed", "mlp")),
      "up_bias": layer((F,), ("mlp",), zeros),
      "down": layer((F, D), ("mlp", "embed")),
      "down_bias": layer((D,), ("embed",), zeros),
      "post_norm": spec((D,), ("embed",), ones),
      "post_norm_bias": spec((D,), ("embed",), zeros),
  }


def _mla_specs(cfg: ModelConfig, layer: Callable[..., ParamSpec], norm: Initializer) -> dict[str, ParamSpec]:
  """The attention weights of a multi-head latent attention layer (`layer` adds the stack's axis)."""
  mla, D, H = cfg.mla, cfg.d_model, cfg.n_heads
  out = {}
  if mla.q_lora_rank:
    out["q_a"] = layer((D, mla.q_lora_rank), ("embed", None))
    out["q_a_norm"] = layer((mla.q_lora_rank,), (None,), norm)
    out["q_b"] = layer((mla.q_lora_rank, H, cfg.qk_head_dim), ("embed", "heads", "head_dim"))
  else:
    out["q"] = layer((D, H, cfg.qk_head_dim), ("embed", "heads", "head_dim"))
  out["kv_a"] = layer((D, mla.kv_lora_rank + cfg.head_dim), ("embed", None))
  out["kv_a_norm"] = layer((mla.kv_lora_rank,), (None,), norm)
  out["kv_b"] = layer((mla.kv_lora_rank, H, mla.qk_nope_head_dim + mla.v_head_dim), ("embed", "heads", "head_dim"))
  out["o"] = layer((H, mla.v_head_dim, D), ("heads", "head_dim", "embed"))
  return out


def _initializers(cfg: ModelConfig) -> tuple[Initializer, Initializer, Initializer]:
  """(weights, zeros, norms): normal(init_std) matrices; (1 + w) norms start at w = 0, so both kinds start as the
  identity scale."""
  zeros = jax.nn.initializers.zeros
  return jax.nn.initializers.normal(cfg.init_std), zeros, zeros if cfg.norm_plus_one else jax.nn.initializers.ones


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
  """Initialises all parameters in `cfg.param_dtype` (jit it to place them sharded)."""
  specs = param_specs(cfg)
  leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
  keys = jax.random.split(key, len(leaves))
  dtype = jnp.dtype(cfg.param_dtype)
  return jax.tree.unflatten(treedef, [s.init(k, s.shape, dtype) for s, k in zip(leaves, keys)])


def abstract_params(cfg: ModelConfig) -> Params:
  """The parameter tree as ShapeDtypeStructs; nothing is allocated."""
  return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


def check_params(cfg: ModelConfig, params: Params, what: str = "params") -> None:
  """Refuses a parameter tree that is not `cfg`'s: other names, or another shape anywhere.

  Args:
    cfg: the model config the parameters are meant for.
    params: the tree (arrays or ShapeDtypeStructs).
    what: how the caller names the tree, for the message.

  Raises:
    ValueError: naming the first parameter that differs and the config fields that decide its shape.
  """
  expected = abstract_params(cfg)
  got_paths = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
  want_paths = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(expected)}
  sizes = (f"n_layers={cfg.n_layers}, d_model={cfg.d_model}, vocab_size={cfg.vocab_size}, n_heads={cfg.n_heads}, "
           f"n_kv_heads={cfg.n_kv_heads}, head_dim={cfg.head_dim}, mlp_dim={cfg.mlp_dim}")
  if got_paths.keys() != want_paths.keys():
    extra, missing = sorted(got_paths.keys() - want_paths.keys()), sorted(want_paths.keys() - got_paths.keys())
    raise ValueError(f"{what} are not the model config's parameters: {len(extra)} not in the config (first "
                     f"{extra[:1]}), {len(missing)} missing (first {missing[:1]}); build the config from the weights' "
                     "own (`ptx.from_pretrained(dir, cfg)`)")
  for path, want in want_paths.items():
    got = tuple(got_paths[path].shape)
    if got != tuple(want.shape):
      raise ValueError(f"{what}{path} has shape {got}, but the model config ({sizes}) makes it {tuple(want.shape)}: "
                       "build the config from the weights' own (`ptx.from_pretrained(dir, cfg)`)")


def logical_axes(cfg: ModelConfig) -> Params:
  """The parameter tree with each leaf replaced by its logical axis names."""
  return jax.tree.map(lambda s: s.logical_axes, param_specs(cfg), is_leaf=_is_spec)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: sharding.Rules = sharding.DEFAULT_RULES) -> Params:
  """NamedSharding per parameter under the parameter rules of `rules`."""
  specs = param_specs(cfg)
  shapes = jax.tree.map(lambda s: s.shape, specs, is_leaf=_is_spec)
  return sharding.named_shardings(logical_axes(cfg), shapes, mesh, rules, kind="params")


def first_layers(params: Params, cfg: ModelConfig) -> Params:
  """The parameters of a deeper model of the same kind cut to `cfg`'s layers: each stack's first ones.

  Raises:
    ValueError: when a stack holds fewer layers than `cfg` needs.
  """
  out = dict(params)
  for stack in STACKS:
    n = len(cfg.stack_layers(stack))
    if stack in params:
      have = jax.tree.leaves(params[stack])[0].shape[0]
      if have < n:
        raise ValueError(f"the parameters' {stack!r} stack holds {have} layers; the model config needs {n}")
      out[stack] = jax.tree.map(lambda x, n=n: x[:n], params[stack])
  return out


def count_params(cfg: ModelConfig) -> int:
  """Number of parameters, taken from `jax.eval_shape` of the real initialiser."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(cfg)))


def count_active_params(cfg: ModelConfig) -> int:
  """Parameters one token runs through: all of them, less the routed experts (weights and biases) it is not sent to."""
  moe = cfg.moe
  if not moe.enabled:
    return count_params(cfg)
  routed = sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=_is_spec)
               if "experts" in s.logical_axes)
  return count_params(cfg) - (moe.n_experts - moe.experts_per_token) * routed // moe.n_experts


def trainable_mask(cfg: ModelConfig) -> Params | None:
  """True for the parameters the optimizer updates; None when it updates all of them (every model without buffers)."""
  mask = jax.tree.map(lambda spec: spec.trainable, param_specs(cfg), is_leaf=_is_spec)
  return None if all(jax.tree.leaves(mask)) else mask


def weight_decay_mask(cfg: ModelConfig) -> Params:
  """True for trainable matrices (decayed), False for norms, biases and what is not trainable (not decayed).

  A routed expert's bias [E, F] is a vector per expert, as a layer's is a vector per layer: not a matrix.
  """

  def is_matrix(spec: ParamSpec) -> bool:
    return spec.trainable and sum(a not in ("layers", "head_dim", "experts") for a in spec.logical_axes) >= 2

  return jax.tree.map(is_matrix, param_specs(cfg), is_leaf=_is_spec)


def _is_spec(x: Any) -> bool:
  return isinstance(x, ParamSpec)
