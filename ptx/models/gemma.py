"""Gemma 2 and Gemma 3 (text) presets."""

from ptx.config import ModelConfig, register_preset


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
