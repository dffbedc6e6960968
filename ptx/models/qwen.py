"""Qwen2/2.5 (qkv bias), Qwen3 (qk-norm) and Qwen3-MoE presets and their HF name maps."""

from ptx.model_config import ModelConfig, MoeConfig, register_preset
from ptx.models.hf_config import HFFamily, register
from ptx.models.llama import HF_NAMES as _LLAMA_NAMES
from ptx.models.llama import MLP_NAMES, MLP_PATHS

_FEATURES = {"norm_plus_one": False, "post_norms": False, "embed_scale": False}
_DEFAULTS = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "use_sliding_window": False}

HF_QWEN2 = register(HFFamily(
    model_type="qwen2", architecture="Qwen2ForCausalLM",
    names={**_LLAMA_NAMES, **{f"layers/{x}_bias": f"model.layers.{{i}}.self_attn.{x}_proj.bias" for x in "qkv"}},
    features={**_FEATURES, "qkv_bias": True, "qk_norm": False}, defaults=_DEFAULTS))

HF_QWEN3 = register(HFFamily(
    model_type="qwen3", architecture="Qwen3ForCausalLM",
    names={**_LLAMA_NAMES, **{f"layers/{x}_norm": f"model.layers.{{i}}.self_attn.{x}_norm.weight" for x in "qk"}},
    features={**_FEATURES, "qkv_bias": False, "qk_norm": True}, defaults=_DEFAULTS))

# Qwen3-MoE: Qwen3's attention; each layer's MLP is a Mixture of Experts (`ptx.models.moe`), but for the layers
# config.json keeps dense (`mlp_only_layers`, `decoder_sparse_step`), whose stack has Qwen3's names.
_QWEN3_ATTENTION = {path: name for path, name in HF_QWEN3.names.items() if path not in MLP_PATHS}
HF_QWEN3_MOE = register(HFFamily(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
    names={**_QWEN3_ATTENTION, "layers/router": "model.layers.{i}.mlp.gate.weight",
           **{f"layers/expert_{x}": f"model.layers.{{i}}.mlp.experts.{{e}}.{x}_proj.weight" for x in MLP_NAMES},
           **{f"dense_{path}": name for path, name in HF_QWEN3.names.items() if path.startswith("layers/")}},
    features={**_FEATURES, "qkv_bias": False, "qk_norm": True}, defaults={**_DEFAULTS, "norm_topk_prob": False},
    moe_keys={"n_experts": ("num_experts", "num_local_experts"), "experts_per_token": ("num_experts_per_tok",),
              "expert_mlp_dim": ("moe_intermediate_size",), "norm_topk_prob": ("norm_topk_prob",)},
    dense_layers="mlp_only_layers"))


@register_preset("qwen2_5_0_5b")
def qwen2_5_0_5b() -> ModelConfig:
  """Qwen2.5-0.5B: 494,032,768 parameters, tied embeddings."""
  return ModelConfig(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                     mlp_dim=4864, qkv_bias=True, tie_embeddings=True, rope_theta=1_000_000.0,
                     norm_eps=1e-6, param_dtype="bfloat16", compute_dtype="bfloat16")


@register_preset("qwen2_5_7b")
def qwen2_5_7b() -> ModelConfig:
  """Qwen2.5-7B: 7,615,616,512 parameters."""
  return ModelConfig(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
                     mlp_dim=18944, qkv_bias=True, rope_theta=1_000_000.0, norm_eps=1e-6,
                     param_dtype="bfloat16", compute_dtype="bfloat16")


@register_preset("qwen3_8b")
def qwen3_8b() -> ModelConfig:
  """Qwen3-8B: 8,190,735,360 parameters."""
  return ModelConfig(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                     mlp_dim=12288, qk_norm=True, rope_theta=1_000_000.0, norm_eps=1e-6,
                     param_dtype="bfloat16", compute_dtype="bfloat16")


@register_preset("qwen3_30b_a3b")
def qwen3_30b_a3b() -> ModelConfig:
  """Qwen3-30B-A3B: 30,532,122,624 parameters, 3,353,032,704 active (128 experts, 8 per token)."""
  return ModelConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                     mlp_dim=6144, qk_norm=True, rope_theta=1_000_000.0, norm_eps=1e-6,
                     moe=MoeConfig(n_experts=128, experts_per_token=8, expert_mlp_dim=768),
                     param_dtype="bfloat16", compute_dtype="bfloat16")


@register_preset("qwen3_235b_a22b")
def qwen3_235b_a22b() -> ModelConfig:
  """Qwen3-235B-A22B: 235,093,634,560 parameters (128 experts, 8 per token)."""
  return ModelConfig(vocab_size=151936, d_model=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
                     mlp_dim=12288, qk_norm=True, rope_theta=1_000_000.0, norm_eps=1e-6,
                     moe=MoeConfig(n_experts=128, experts_per_token=8, expert_mlp_dim=1536),
                     param_dtype="bfloat16", compute_dtype="bfloat16")
