"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): queries, keys and values through low-rank latents.

A token's keys and values come from one latent c = RMSNorm(x kv_a)[:C] of rank C (`mla.kv_lora_rank`) and one
rotary key part k_pe = RoPE(x kv_a)[C:] of `head_dim` that every head shares; its queries from RMSNorm(x q_a) q_b
(or x q). Per head, K = [c kv_b_k ; k_pe] and V = c kv_b_v: the naive form, ordinary attention whose values are
narrower than its queries and keys (Kv vs Kn + K), run through `ptx.models.attention` as any layer's is. It serves
training and prefill without a cache. Decoding against a cache of latents (the absorbed form) is not built yet:
`refuse_cache` says so before anything compiles.

Rotary parts follow ptx's `rotate_half` layout; HF checkpoints that store them interleaved are permuted on load
and save (`ptx.models.deepseek`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ptx.model_config import ModelConfig
from ptx.models import lora, rope
from ptx.models.rms_norm import rms_norm

Params = dict[str, jax.Array]


def queries_keys_values(p: Params, h: jax.Array, cfg: ModelConfig, *, sin: jax.Array,
                        cos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One layer's q [B, T, H, Kn + K], k [B, T, H, Kn + K] and v [B, T, H, Kv] from the normed residual h [B, T, D]."""
  mla, dtype = cfg.mla, cfg.compute_dtype
  if mla.q_lora_rank:
    q_latent = rms_norm(lora.project("btd,dr->btr", h, p["q_a"], dtype), p["q_a_norm"], cfg)
    q = lora.project("btr,rhk->bthk", q_latent, p["q_b"], dtype)
  else:
    q = lora.project("btd,dhk->bthk", h, p["q"], dtype)
  q_nope, q_pe = jnp.split(q, [mla.qk_nope_head_dim], axis=-1)
  latent, k_pe = jnp.split(lora.project("btd,dr->btr", h, p["kv_a"], dtype), [mla.kv_lora_rank], axis=-1)
  kv = lora.project("btr,rhk->bthk", rms_norm(latent, p["kv_a_norm"], cfg), p["kv_b"], dtype)
  k_nope, v = jnp.split(kv, [mla.qk_nope_head_dim], axis=-1)
  k_pe = rope.apply_rope(k_pe[:, :, None], sin, cos)  # [B, T, 1, K]: one rotary key per token, for every head
  q = jnp.concatenate([q_nope, rope.apply_rope(q_pe, sin, cos)], axis=-1)
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, k_nope.shape[:3] + k_pe.shape[3:])], axis=-1)
  return q, k, v


def softmax_scale(cfg: ModelConfig) -> float:
  """(Kn + K)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 where the scaling sets mscale_all_dim.

  DeepSeek's rule (transformers `yarn_apply_mscale`): the temperature that YaRN's attention factor takes off cos
  and sin (`rope.attention_factor`, mscale / mscale_all_dim) comes back, squared, on the logits.
  """
  scale = cfg.qk_head_dim ** -0.5
  s = cfg.rope_scaling
  if s.kind == "yarn" and s.mscale_all_dim:
    scale *= rope.yarn_mscale(s.factor, s.mscale_all_dim) ** 2
  return scale


def refuse_cache(cfg: ModelConfig) -> None:
  """Raises ValueError for an MLA model about to sample with a KV cache (contiguous or paged): not built yet.

  Raises:
    ValueError: naming model.mla, when `cfg.mla` is enabled.
  """
  if cfg.mla.enabled:
    raise ValueError(f"model.mla (kv_lora_rank={cfg.mla.kv_lora_rank}): sampling with a KV cache is not built yet "
                     "for multi-head latent attention (its latent cache and absorbed decode come next); training "
                     "and log-prob passes without a cache run")
