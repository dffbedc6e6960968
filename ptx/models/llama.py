"""Llama 3 family presets (and SmolLM2, a Llama-architecture model)."""

from ptx.config import ModelConfig, RopeScaling, register_preset

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
