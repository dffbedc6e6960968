"""Gemma 2 and Gemma 3 (text) presets and their HF name maps.

Gemma's (1 + w) norms keep HF's stored w as is (`norm_plus_one`). Its
`post_attention_layernorm` normalises the attention output (ptx
`attn_post_norm`); the pre-MLP norm is `pre_feedforward_layernorm`.
"""

from ptx.model_config import ModelConfig, register_preset
from ptx.models.hf_config import HFFamily, register
from ptx.models.llama import HF_NAMES as _LLAMA_NAMES

_GEMMA2_NAMES = {
    **_LLAMA_NAMES,
    "layers/attn_post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "layers/mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "layers/mlp_post_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}
_GEMMA3_NAMES = {**_GEMMA2_NAMES, **{f"layers/{x}_norm": f"model.layers.{{i}}.self_attn.{x}_norm.weight" for x in "qk"}}
_FEATURES = {"norm_plus_one": True, "post_norms": True, "embed_scale": True, "qkv_bias": False}
# transformers' Gemma2Config / Gemma3TextConfig defaults: Gemma 3 multimodal
# config.json files list only the text_config keys that differ from them.
_GEMMA2_DEFAULTS = {
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "rope_theta": 10_000.0,
    "sliding_window": 4096, "sliding_window_pattern": 2, "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
}
_GEMMA3_DEFAULTS = {
    **_GEMMA2_DEFAULTS, "vocab_size": 262208, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "sliding_window_pattern": 6, "attn_logit_softcapping": None, "final_logit_softcapping": None,
}

HF_GEMMA2 = register(HFFamily(
    model_type="gemma2", architecture="Gemma2ForCausalLM", names=_GEMMA2_NAMES,
    features={**_FEATURES, "qk_norm": False}, defaults=_GEMMA2_DEFAULTS))

HF_GEMMA3 = register(HFFamily(
    model_type="gemma3_text", architecture="Gemma3ForCausalLM", names=_GEMMA3_NAMES,
    features={**_FEATURES, "qk_norm": True}, defaults=_GEMMA3_DEFAULTS))

# The text decoder inside a Gemma 3 image-text checkpoint; the vision tower is skipped.
HF_GEMMA3_MULTIMODAL = register(HFFamily(
    model_type="gemma3", architecture="Gemma3ForConditionalGeneration", names=_GEMMA3_NAMES,
    features=HF_GEMMA3.features, defaults=_GEMMA3_DEFAULTS, nested="text_config",
    aliases=(("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head.")),
    ignored=("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")))


@register_preset("gemma2_2b")
def gemma2_2b() -> ModelConfig:
  """Gemma-2-2B: 2,614,341,888 parameters."""
  return ModelConfig(vocab_size=256000, d_model=2304, n_layers=26, n_heads=8, n_kv_heads=4, head_dim=256,
                     mlp_dim=9216, activation="gelu_tanh", norm_eps=1e-6, norm_plus_one=True,
                     post_norms=True, embed_scale=True, tie_embeddings=True, rope_theta=10_000.0,
                     sliding_window=4096, sliding_window_pattern=2, attn_logit_softcap=50.0,
                     final_logit_softcap=30.0, query_pre_attn_scalar=256.0,
                     param_dtype="bfloat16", compute_dtype="bfloat16")


@register_preset("gemma2_9b")
def gemma2_9b() -> ModelConfig:
  """Gemma-2-9B: 9,241,705,984 parameters."""
  from dataclasses import replace
  return replace(gemma2_2b(), d_model=3584, n_layers=42, n_heads=16, n_kv_heads=8, mlp_dim=14336)


@register_preset("gemma3_1b")
def gemma3_1b() -> ModelConfig:
  """Gemma-3-1B: 999,885,952 parameters; 5 local layers per global one."""
  return ModelConfig(vocab_size=262144, d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256,
                     mlp_dim=6912, activation="gelu_tanh", norm_eps=1e-6, norm_plus_one=True,
                     post_norms=True, qk_norm=True, embed_scale=True, tie_embeddings=True,
                     rope_theta=1_000_000.0, rope_local_theta=10_000.0, sliding_window=512,
                     sliding_window_pattern=6, query_pre_attn_scalar=256.0,
                     param_dtype="bfloat16", compute_dtype="bfloat16")
