"""Config variants shared by model, sampler and CLI tests (importable: conftest modules are not)."""

import dataclasses

from ptx.model_config import ModelConfig, MoeConfig

# The HF checkpoint of the CLI tests (`ptx_checkpoint` in conftest.py): a 2-layer Llama with a vocabulary the byte
# tokenizer fits; dimensions distinct so a swapped axis fails to load.
HF_ARCH = ModelConfig(vocab_size=272, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, mlp_dim=80,
                      rope_theta=10_000.0)


def gemma_like(cfg):
  """The tiny config with every Gemma 2/3 feature switched on."""
  return dataclasses.replace(
      cfg, activation="gelu_tanh", norm_plus_one=True, post_norms=True, qk_norm=True, embed_scale=True,
      tie_embeddings=True, sliding_window=3, sliding_window_pattern=2, attn_logit_softcap=5.0,
      final_logit_softcap=3.0, query_pre_attn_scalar=20.0, rope_local_theta=100.0)


def moe_like(cfg, *, impl="dense", shared_mlp_dim=24, router_bias=True):
  """The tiny config with Mixture-of-Experts MLPs: 6 experts of width 16, 2 per token, shared experts, a router bias."""
  return dataclasses.replace(cfg, moe_impl=impl, moe=MoeConfig(n_experts=6, experts_per_token=2, expert_mlp_dim=16,
                                                               shared_mlp_dim=shared_mlp_dim, router_bias=router_bias))


def mla_like(cfg, *, q_lora_rank=20, rope=4, nope=10, v=6, kv_lora_rank=12):
  """The tiny config with multi-head latent attention: one head per key/value head, a rotary width of 4."""
  from ptx.model_config import MlaConfig

  return dataclasses.replace(cfg, n_kv_heads=cfg.n_heads, head_dim=rope, mla=MlaConfig(
      q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=nope, v_head_dim=v))
