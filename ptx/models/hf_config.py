"""HF `config.json` <-> `ModelConfig`, and the registry of HF model families.

A family (`HFFamily`, declared in the family files llama.py, qwen.py and
gemma.py) says which `model_type` it reads, which `ModelConfig` fields it
fixes, and the HF name of every ptx parameter. `model_config` reads both the
transformers 4 keys (`rope_theta`, `rope_scaling`, `sliding_window_pattern`,
`rope_local_base_freq`) and the transformers 5 ones (`rope_parameters`,
`layer_types`); `hf_config` writes the 4-style keys plus `layer_types`, which
every transformers version since 4.53 reads.

Anything that ptx's decoder cannot represent (an unknown rope type, an output
bias, a layer pattern that is not "every p-th layer global") raises
`HFConfigError` instead of loading a subtly different model.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal, Mapping

import numpy as np

from ptx.model_config import MlaConfig, ModelConfig, MoeConfig, RopeScaling, VisionConfig
from ptx.models.hf_layout import HF_LAYOUTS, Layout

_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# config.json keys whose value the decoder fixes for every family (unless `HFFamily.fixed` says otherwise).
_FIXED = {"mlp_bias": False, "attention_bias": False, "use_bidirectional_attention": False}
# ModelConfig field -> config.json key, for the Gemma-only attention options.
_GEMMA_KEYS = (("attn_logit_softcap", "attn_logit_softcapping"), ("final_logit_softcap", "final_logit_softcapping"),
               ("query_pre_attn_scalar", "query_pre_attn_scalar"))


class HFConfigError(ValueError):
  """A config.json that ptx cannot represent exactly (or a ModelConfig HF cannot)."""


@dataclasses.dataclass(frozen=True)
class HFFamily:
  """How one HF `model_type` maps onto the ptx decoder."""

  # config.json `model_type` this family reads (and writes, unless `nested`).
  model_type: str
  # transformers class name written to `architectures`.
  architecture: str
  # ptx parameter path ("embed", "layers/q") -> HF tensor name; "{i}" is the layer.
  names: dict[str, str]
  # ModelConfig fields that the family fixes, e.g. Gemma's norm_plus_one=True.
  features: dict[str, Any]
  # config.json defaults of the transformers class, for keys a file may omit.
  defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Key of the text config inside a multimodal config.json (Gemma 3: "text_config").
  nested: str | None = None
  # Checkpoint name prefixes rewritten before matching (multimodal wrappers).
  aliases: tuple[tuple[str, str], ...] = ()
  # Checkpoint name prefixes that belong to other towers and are skipped.
  ignored: tuple[str, ...] = ()
  # Mixture-of-Experts families: MoeConfig field -> its config.json keys (the first is written; the others are
  # older or newer spellings read too). Names of per-expert tensors hold "{e}", the expert.
  moe_keys: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  # MoeConfig fields the family fixes (Mixtral always renormalises its k gate weights).
  moe_fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
  # How config.json places dense layers among the MoE layers (`moe.dense_layers`), whose weights are named by the
  # "dense_layers/..." entries: "mlp_only_layers" (Qwen3-MoE: those layers, and those off `decoder_sparse_step`),
  # "first_k_dense_replace" (DeepSeek-V3: the first k layers), or None (every layer's MLP is a Mixture of Experts).
  dense_layers: Literal["mlp_only_layers", "first_k_dense_replace"] | None = None
  # Multi-head latent attention (`model.mla`) from config.json's q_lora_rank, kv_lora_rank, qk_nope_head_dim,
  # qk_rope_head_dim (model.head_dim) and v_head_dim; the checkpoint's rotary rows of "layers/q", "layers/q_b" and
  # "layers/kv_a" are GPT-J interleaved where `rope_interleave` is true (`interleaved_rope_rows`).
  mla: bool = False
  # config.json key counting extra layers after the last, whose tensors the decoder skips (DeepSeek-V3's
  # multi-token prediction modules, `num_nextn_predict_layers`, as transformers skips them).
  extra_layers_key: str | None = None
  # ModelConfig field -> the config.json key of this family that holds it (gpt-oss's `swiglu_limit`), read and written.
  keys: dict[str, str] = dataclasses.field(default_factory=dict)
  # config.json keys whose value the decoder fixes for this family beyond `_FIXED` (gpt-oss's attention_bias true):
  # a file with another value is refused; written as they are.
  fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Where each parameter's axes sit in its HF tensor (`ptx.models.hf_layout`; gpt-oss: `FUSED_EXPERTS`).
  layouts: Mapping[str, Layout] = dataclasses.field(default_factory=lambda: HF_LAYOUTS)
  # A SigLIP vision tower and pixel-shuffle connector (Idefics3, SmolVLM; `model.vision`): the transformers
  # class's defaults of config.json's top level (`scale_factor`, `image_token_id`) and of its `vision_config`,
  # nested under "vision_config"; None: a text model.
  vision: dict[str, Any] | None = None


FAMILIES: dict[str, HFFamily] = {}


def register(family: HFFamily) -> HFFamily:
  """Registers `family` under its model_type (called by the family files)."""
  if family.model_type in FAMILIES:
    raise ValueError(f"HF model_type {family.model_type!r} is registered twice")
  FAMILIES[family.model_type] = family
  return family


def family_of(hf: dict[str, Any], where: str) -> HFFamily:
  """Returns the family of a config.json dict, or raises naming the model_type."""
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise HFConfigError(f"{where}: unsupported model_type {model_type!r}; ptx reads {sorted(FAMILIES)}")
  return FAMILIES[model_type]


def model_config(hf: dict[str, Any], family: HFFamily, dtype: str | None = None,
                 where: str = "config.json") -> ModelConfig:
  """Builds the ModelConfig of a config.json dict.

  Args:
    hf: the parsed config.json.
    family: its family (see `family_of`).
    dtype: param and compute dtype; None takes the file's `torch_dtype`/`dtype`.
    where: the file, for error messages.

  Returns:
    The ModelConfig.

  Raises:
    HFConfigError: naming the key that ptx cannot represent.
  """
  dtype = dtype or _DTYPES.get(str(hf.get("torch_dtype") or hf.get("dtype")), "float32")
  outer = hf
  if family.nested:
    hf = hf.get(family.nested) or {}
  c = {**family.defaults, **hf}

  def need(key):
    if c.get(key) is None:
      raise HFConfigError(f"{where}: missing {key!r}")
    return c[key]

  for key, value in {**_FIXED, **family.fixed}.items():
    if c.get(key) is not None and c[key] != value:
      raise HFConfigError(f"{where}: {key}={json.dumps(c[key])} is not supported by the ptx decoder for "
                          f"{family.model_type} (only {json.dumps(value)})")
  activation = c.get("hidden_activation") or c.get("hidden_act")
  if activation not in _ACTIVATIONS:
    raise HFConfigError(f"{where}: hidden activation {activation!r} is not one of {sorted(_ACTIVATIONS)}")
  n_heads, d_model = need("num_attention_heads"), need("hidden_size")
  n_layers = need("num_hidden_layers")
  global_rope, local_rope = _rope(c, where)
  if c.get("sliding_window") and "sliding_window" not in family.defaults and "use_sliding_window" not in c:
    raise HFConfigError(f"{where}: sliding_window={c['sliding_window']} on every layer is not supported for "
                        f"{family.model_type}")
  pattern = _window_pattern(_layer_types(c, n_layers), where)
  cfg = ModelConfig(
      vocab_size=need("vocab_size"), d_model=d_model, n_layers=n_layers, n_heads=n_heads,
      n_kv_heads=c.get("num_key_value_heads") or n_heads,
      head_dim=(need("qk_rope_head_dim") if family.mla else c.get("head_dim")) or d_model // n_heads,
      mlp_dim=need("intermediate_size"), activation=_ACTIVATIONS[activation], norm_eps=need("rms_norm_eps"),
      tie_embeddings=bool(c.get("tie_word_embeddings", False)), rope_theta=float(global_rope[0]),
      rope_scaling=global_rope[1], rope_local_theta=None if local_rope is None else float(local_rope),
      sliding_window=None if pattern is None else need("sliding_window"),
      sliding_window_pattern=pattern or 1, attn_logit_softcap=c.get("attn_logit_softcapping"),
      final_logit_softcap=c.get("final_logit_softcapping"), param_dtype=dtype, compute_dtype=dtype)
  if "query_pre_attn_scalar" in c:
    cfg = dataclasses.replace(cfg, query_pre_attn_scalar=float(c["query_pre_attn_scalar"]))
  cfg = dataclasses.replace(cfg, **{field: need(key) for field, key in family.keys.items()})
  try:
    if family.moe_keys:
      cfg = dataclasses.replace(cfg, moe=_moe(c, family, n_layers, where))
    if family.mla:
      cfg = dataclasses.replace(cfg, mla=MlaConfig(
          q_lora_rank=c.get("q_lora_rank") or 0, kv_lora_rank=need("kv_lora_rank"),
          qk_nope_head_dim=need("qk_nope_head_dim"), v_head_dim=need("v_head_dim")))
    if family.vision is not None:
      cfg = dataclasses.replace(cfg, vision=_vision(outer, family.vision, where))
    return dataclasses.replace(cfg, **family.features)
  except HFConfigError:
    raise
  except ValueError as e:
    raise HFConfigError(f"{where}: {e}") from None


def _vision(hf: dict[str, Any], defaults: dict[str, Any], where: str) -> VisionConfig:
  """The VisionConfig of an Idefics3 / SmolVLM config.json (its `vision_config`, `scale_factor`, `image_token_id`)."""
  top = {**defaults, **hf}
  v = {**defaults["vision_config"], **(hf.get("vision_config") or {})}
  if v["hidden_act"] != "gelu_pytorch_tanh":
    raise HFConfigError(f"{where}: vision_config hidden_act={v['hidden_act']!r} is not supported (gelu_pytorch_tanh)")
  for key in ("image_size", "patch_size"):
    if not isinstance(v[key], int):
      raise HFConfigError(f"{where}: vision_config {key}={v[key]!r} must be one int (square images and patches)")
  return VisionConfig(depth=v["num_hidden_layers"], image_size=v["image_size"], patch_size=v["patch_size"],
                      channels=v["num_channels"], width=v["hidden_size"], n_heads=v["num_attention_heads"],
                      mlp_dim=v["intermediate_size"], norm_eps=v["layer_norm_eps"], scale_factor=top["scale_factor"],
                      image_token_id=top["image_token_id"])


def _moe(c: dict[str, Any], family: HFFamily, n_layers: int, where: str) -> MoeConfig:
  """The MoeConfig of a Mixture-of-Experts config.json.

  Layer i keeps its dense MLP when it is in `mlp_only_layers` or (i + 1) is not a multiple of
  `decoder_sparse_step` (transformers' Qwen3-MoE rule), for a family that has the keys (`dense_layers`).
  """
  step, only, first = c.get("decoder_sparse_step") or 1, c.get("mlp_only_layers") or [], 0
  if family.dense_layers == "first_k_dense_replace":
    first = c.get("first_k_dense_replace") or 0
    for key, supported in (("moe_layer_freq", 1), ("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
      if c.get(key, supported) != supported:
        raise HFConfigError(f"{where}: {key}={c[key]!r} is not supported ({family.model_type}: {supported!r})")
  dense = tuple(i for i in range(n_layers) if i < first or i in only or (i + 1) % step)
  if dense and not family.dense_layers:
    raise HFConfigError(f"{where}: decoder_sparse_step={step}, mlp_only_layers={only}: {family.model_type} has no "
                        "dense layers among its MoE layers")
  values = {"dense_layers": dense} if dense else {}
  for field, keys in family.moe_keys.items():
    key = next((k for k in keys if c.get(k) is not None), None)
    if key is None:
      raise HFConfigError(f"{where}: missing {keys[0]!r}")
    values[field] = c[key]
  if "n_shared_experts" in family.moe_keys.get("shared_mlp_dim", ()):  # shared experts counted in routed widths
    values["shared_mlp_dim"] *= values["expert_mlp_dim"]
  return MoeConfig(**values, **family.moe_fixed)


def hf_config(cfg: ModelConfig, family: HFFamily) -> dict[str, Any]:
  """Returns the config.json dict of `cfg` as `family` (which must fit it exactly).

  Raises:
    HFConfigError: when the family cannot express a field of `cfg`.
  """
  for field, value in family.features.items():
    if getattr(cfg, field) != value:
      raise HFConfigError(f"{family.model_type} needs model.{field}={value!r}, got {getattr(cfg, field)!r}")
  name = family.model_type
  if cfg.activation not in _ACTIVATIONS.values() and "activation" not in family.features:
    raise HFConfigError(f"{name} has no model.activation={cfg.activation!r}")
  for field in ("o_bias", "attention_sinks"):
    if getattr(cfg, field) and not family.features.get(field):
      raise HFConfigError(f"{name} has no model.{field}; got {getattr(cfg, field)}")
  if cfg.vision.enabled != (family.vision is not None):
    raise HFConfigError(f"{name} {'has' if family.vision is not None else 'has no'} vision tower; got "
                        f"model.vision.depth={cfg.vision.depth}")
  if cfg.mla.enabled != family.mla:
    raise HFConfigError(f"{name} {'has' if family.mla else 'has no'} multi-head latent attention; got "
                        f"model.mla.kv_lora_rank={cfg.mla.kv_lora_rank}")
  if cfg.moe.enabled != bool(family.moe_keys):
    raise HFConfigError(f"{name} {'has' if family.moe_keys else 'has no'} Mixture-of-Experts layers; got "
                        f"model.moe.n_experts={cfg.moe.n_experts}")
  for field in dataclasses.fields(MoeConfig):
    expected = family.moe_fixed.get(field.name, field.default)
    free = field.name in family.moe_keys or (field.name == "dense_layers" and family.dense_layers is not None)
    if family.moe_keys and not free and getattr(cfg.moe, field.name) != expected:
      raise HFConfigError(f"{name} needs model.moe.{field.name}={expected!r}, got {getattr(cfg.moe, field.name)!r}")
  if cfg.sliding_window is not None and "sliding_window" not in family.defaults:
    raise HFConfigError(f"{name} has no sliding-window layers; got model.sliding_window={cfg.sliding_window}")
  if "rope_local_base_freq" in family.defaults:
    # Gemma 3's local layers never scale RoPE; ptx's do when they share the global base.
    if cfg.rope_local_theta is None and cfg.rope_scaling.kind != "none" and any(_layer_windows(cfg)):
      raise HFConfigError(f"{name}: local layers would lose the RoPE scaling; set model.rope_local_theta")
  elif cfg.rope_local_theta is not None:
    raise HFConfigError(f"{name} has one RoPE base; got model.rope_local_theta={cfg.rope_local_theta}")
  for field, key in _GEMMA_KEYS:
    value = getattr(cfg, field)
    default_scale = key == "query_pre_attn_scalar" and value == cfg.head_dim
    if value is not None and key not in family.defaults and not default_scale:
      raise HFConfigError(f"{name} has no {key}; got model.{field}={value}")
  out = {
      "architectures": [family.architecture], "model_type": family.model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
      "intermediate_size": cfg.mlp_dim, "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "rope_theta": cfg.rope_theta, "rope_scaling": _rope_scaling_dict(cfg.rope_scaling),
      "torch_dtype": cfg.param_dtype,
  }
  out["hidden_activation" if cfg.activation == "gelu_tanh" else "hidden_act"] = (
      "gelu_pytorch_tanh" if cfg.activation == "gelu_tanh" else "silu")
  if "sliding_window" in family.defaults:
    out["sliding_window"] = cfg.sliding_window
    out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in _layer_windows(cfg)]
    out["sliding_window_pattern"] = cfg.sliding_window_pattern
  if "rope_local_base_freq" in family.defaults:
    out["rope_local_base_freq"] = cfg.rope_local_theta or cfg.rope_theta
  for field, key in _GEMMA_KEYS[:2]:
    if key in family.defaults:
      out[key] = getattr(cfg, field)
  if "query_pre_attn_scalar" in family.defaults:
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    out["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar  # transformers wants int
  out.update({keys[0]: getattr(cfg.moe, field) for field, keys in family.moe_keys.items()})
  out.update({key: getattr(cfg, field) for field, key in family.keys.items()})
  out.update(family.fixed)
  if "n_shared_experts" in out:
    if cfg.moe.shared_mlp_dim % cfg.moe.expert_mlp_dim:
      raise HFConfigError(f"{name} counts shared experts in routed experts' widths: model.moe.shared_mlp_dim="
                          f"{cfg.moe.shared_mlp_dim} must be a multiple of expert_mlp_dim={cfg.moe.expert_mlp_dim}")
    out["n_shared_experts"] = cfg.moe.shared_mlp_dim // cfg.moe.expert_mlp_dim
  dense = cfg.moe.dense_layers
  if family.dense_layers == "mlp_only_layers":
    out.update(decoder_sparse_step=1, mlp_only_layers=list(dense))
  elif family.dense_layers == "first_k_dense_replace":
    if dense != tuple(range(len(dense))):
      raise HFConfigError(f"{name} keeps only its first layers dense; got model.moe.dense_layers={list(dense)}")
    out["first_k_dense_replace"] = len(dense)
  if family.mla:
    mla = cfg.mla
    out.update(q_lora_rank=mla.q_lora_rank or None, kv_lora_rank=mla.kv_lora_rank,
               qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=cfg.head_dim, v_head_dim=mla.v_head_dim,
               rope_interleave=True)
  return out


def interleaved_rope_rows(hf: dict[str, Any], family: HFFamily, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """ptx parameter path -> the checkpoint row (of its HF tensor's first axis) of each ptx-ordered row.

  MLA checkpoints with `rope_interleave` (DeepSeek-V3's default) store each rotary part GPT-J interleaved, pairs
  (x0, x1), (x2, x3), ...; ptx rotates halves (`ptx.models.rope`), so the loader reads rows in this order and the
  saver writes them back through it (a permutation: bit-exact both ways). Empty for other checkpoints.
  """
  if not family.mla or not {**family.defaults, **hf}.get("rope_interleave", True):
    return {}

  def rows(n: int, block: int) -> np.ndarray:
    rotary = np.arange(cfg.head_dim).reshape(-1, 2).T.reshape(-1)  # evens, then odds
    per_block = np.concatenate([np.arange(block - cfg.head_dim), block - cfg.head_dim + rotary])
    return (np.arange(0, n, block)[:, None] + per_block[None]).reshape(-1)

  query, latent = ("q_b" if cfg.mla.q_lora_rank else "q"), cfg.mla.kv_lora_rank + cfg.head_dim
  return {f"{stack}/{leaf}": order for stack in ("layers", "dense_layers")
          for leaf, order in ((query, rows(cfg.n_heads * cfg.qk_head_dim, cfg.qk_head_dim)),
                              ("kv_a", rows(latent, latent)))}


def _rope(c: dict[str, Any], where: str) -> tuple[tuple[float, RopeScaling], float | None]:
  """((global theta, global scaling), local theta or None) from either key style."""
  params = c.get("rope_parameters")
  if params and "full_attention" in params:
    full, local = params["full_attention"], params.get("sliding_attention")
    if local is not None and local.get("rope_type", "default") != "default":
      raise HFConfigError(f"{where}: sliding-layer rope_type {local['rope_type']!r} is not supported")
    return (float(full["rope_theta"]), _scaling(full, where)), None if local is None else local["rope_theta"]
  if params:
    return (float(params["rope_theta"]), _scaling(params, where)), None
  local = c.get("rope_local_base_freq")
  return (float(c.get("rope_theta", 10_000.0)), _scaling(c.get("rope_scaling") or {}, where)), local


def _scaling(rope: dict[str, Any], where: str) -> RopeScaling:
  kind = rope.get("rope_type", rope.get("type", "default"))
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    raise HFConfigError(f"{where}: partial_rotary_factor={rope['partial_rotary_factor']} is not supported")
  if kind == "default":
    return RopeScaling()
  if kind == "linear":
    return RopeScaling(kind="linear", factor=float(rope["factor"]))
  if kind == "llama3":
    return RopeScaling(kind="llama3", factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                       high_freq_factor=float(rope["high_freq_factor"]),
                       original_max_positions=int(rope["original_max_position_embeddings"]))
  if kind == "yarn":
    return RopeScaling(kind="yarn", factor=float(rope["factor"]),
                       original_max_positions=int(rope["original_max_position_embeddings"]),
                       beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                       attention_factor=rope.get("attention_factor"), mscale=float(rope.get("mscale") or 0.0),
                       mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0), truncate=rope.get("truncate", True))
  raise HFConfigError(f"{where}: rope_type {kind!r} is not supported (default, linear, llama3, yarn)")


def _rope_scaling_dict(s: RopeScaling) -> dict[str, Any] | None:
  if s.kind == "none":
    return None
  if s.kind == "linear":
    return {"rope_type": "linear", "factor": s.factor}
  if s.kind == "yarn":
    out = {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings": s.original_max_positions,
           "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate}
    optional = {"attention_factor": s.attention_factor, "mscale": s.mscale, "mscale_all_dim": s.mscale_all_dim}
    return {**out, **{key: value for key, value in optional.items() if value}}
  return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
          "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_positions}


def _layer_types(c: dict[str, Any], n_layers: int) -> list[bool]:
  """True for sliding-window layers, following the transformers rules per key."""
  if c.get("layer_types"):
    return [t == "sliding_attention" for t in c["layer_types"]]
  if "use_sliding_window" in c:  # Qwen2/3: layers from max_window_layers on slide
    start = c.get("max_window_layers") or 0
    return [bool(c["use_sliding_window"] and c.get("sliding_window")) and i >= start for i in range(n_layers)]
  pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern")
  if pattern and c.get("sliding_window"):
    return [(i + 1) % pattern != 0 for i in range(n_layers)]
  return [False] * n_layers


def _window_pattern(sliding: list[bool], where: str) -> int | None:
  """The ptx pattern p (layer i global iff (i + 1) % p == 0), None if all global."""
  if not any(sliding):
    return None
  if all(sliding):
    return 1
  p = sliding.index(False) + 1
  if sliding != [(i + 1) % p != 0 for i in range(len(sliding))]:
    raise HFConfigError(f"{where}: layer_types {sliding} is not 'every {p}-th layer global'")
  return p


def _layer_windows(cfg: ModelConfig) -> list[bool]:
  if cfg.sliding_window is None:
    return [False] * cfg.n_layers
  if cfg.sliding_window_pattern == 1:
    return [True] * cfg.n_layers
  return [(i + 1) % cfg.sliding_window_pattern != 0 for i in range(cfg.n_layers)]
