"""Llama 3 family presets (and SmolLM2, a Llama-architecture model) and the HF name map."""

from ptx.model_config import ModelConfig, RopeScaling, register_preset
from ptx.models.hf_config import HFFamily, register

# ptx parameter path -> HF tensor name; "{i}" is the layer. Qwen extends it.
HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "layers/attn_norm": "model.layers.{i}.input_layernorm.weight",
    "layers/q": "model.layers.{i}.self_attn.q_proj.weight",
    "layers/k": "model.layers.{i}.self_attn.k_proj.weight",
    "layers/v": "model.layers.{i}.self_attn.v_proj.weight",
    "layers/o": "model.layers.{i}.self_attn.o_proj.weight",
    "layers/mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "layers/gate": "model.layers.{i}.mlp.gate_proj.weight",
    "layers/up": "model.layers.{i}.mlp.up_proj.weight",
    "layers/down": "model.layers.{i}.mlp.down_proj.weight",
}

# The dense MLP's parameters, and their HF projection names (Mixture-of-Experts families name their experts' alike).
MLP_PATHS = ("layers/gate", "layers/up", "layers/down")
MLP_NAMES = ("gate", "up", "down")

HF_LLAMA = register(HFFamily(
    model_type="llama", architecture="LlamaForCausalLM", names=HF_NAMES,
    features={"qkv_bias": False, "qk_norm": False, "norm_plus_one": False, "post_norms": False,
              "embed_scale": False},
    defaults={"rms_norm_eps": 1e-6, "hidden_act": "silu"}))

_LLAMA31_ROPE = RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_positions=8192)


@register_preset("llama3_8b")
def llama3_8b() -> ModelConfig:
  """Meta-Llama-3-8B: 8,030,261,248 parameters."""
  return ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                     mlp_dim=14336, rope_theta=500_000.0, norm_eps=1e-5, param_dtype="bfloat16",
                     compute_dtype="bfloat16")


@register_preset("llama3_1_8b")
def llama3_1_8b() -> ModelConfig:
  """Llama-3.1-8B: Llama-3-8B with Llama 3.1 RoPE scaling (128K context)."""
  from dataclasses import replace
  return replace(llama3_8b(), rope_scaling=_LLAMA31_ROPE)


@register_preset("llama3_2_1b")
def llama3_2_1b() -> ModelConfig:
  """Llama-3.2-1B: 1,235,814,400 parameters, tied embeddings."""
  return ModelConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                     mlp_dim=8192, rope_theta=500_000.0, norm_eps=1e-5, tie_embeddings=True,
                     rope_scaling=RopeScaling(kind="llama3", factor=32.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_positions=8192),
                     param_dtype="bfloat16", compute_dtype="bfloat16")


@register_preset("smollm2_135m")
def smollm2_135m() -> ModelConfig:
  """SmolLM2-135M(-Instruct): 134,515,008 parameters, tied embeddings."""
  return ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                     mlp_dim=1536, rope_theta=100_000.0, norm_eps=1e-5, tie_embeddings=True)


@register_preset("tiny")
def tiny() -> ModelConfig:
  """A 2-layer Llama-style model for tests, demos and CPU smoke runs."""
  return ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                     mlp_dim=384, rope_theta=10_000.0)
