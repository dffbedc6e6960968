"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): queries, keys and values through low-rank latents.

A token's keys and values come from one latent c = RMSNorm(x kv_a)[:C] of rank C (`mla.kv_lora_rank`) and one
rotary key part k_pe = RoPE(x kv_a)[C:] of `head_dim` that every head shares; its queries from RMSNorm(x q_a) q_b
(or x q). Per head, with kv_b = [W_UK ; W_UV] split along its output:

- the naive form (`queries_keys_values`): K = [c W_UK ; k_pe] and V = c W_UV, ordinary attention whose values are
  narrower than its queries and keys (Kv vs Kn + K), run through `ptx.models.attention` as any layer's is. It
  serves training and every pass without a cache.
- the absorbed form (`absorbed_queries_and_latents`, `latent_values`): W_UK moves onto the query,
  q_lat = q_nope W_UK^T, and each head attends with [q_lat ; q_pe] over the cached [c ; k_pe] with values c: one
  KV head of width C + K whose values are its first C columns, then W_UV expands the attended latent to Kv. The
  scores and outputs are the naive form's, re-associated; the cache holds C + K numbers a token and layer
  (`ptx.models.kv_cache`, `ptx.models.paged_kv_cache`) instead of H (Kn + K + Kv). Every forward against a cache
  (prefill and decode) takes this form, so a sampler's prompt and its tokens see one arithmetic.

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
  q_nope, q_pe = _queries(p, h, cfg, sin=sin, cos=cos)
  latent, k_pe = _latents(p, h, cfg, sin=sin, cos=cos)
  kv = lora.project("btr,rhk->bthk", latent, p["kv_b"], cfg.compute_dtype)
  k_nope, v = jnp.split(kv, [cfg.mla.qk_nope_head_dim], axis=-1)
  q = jnp.concatenate([q_nope, q_pe], axis=-1)
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, k_nope.shape[:3] + k_pe.shape[3:])], axis=-1)
  return q, k, v


def absorbed_queries_and_latents(p: Params, h: jax.Array, cfg: ModelConfig, *, sin: jax.Array,
                                 cos: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The absorbed form's queries [B, T, H, C + K] and cache entries [B, T, 1, C + K] from the normed residual h.

  A cache entry is [c ; k_pe], one KV head every query head reads; its first C columns are also the values
  (`latent_values` expands what attention makes of them).
  """
  q_nope, q_pe = _queries(p, h, cfg, sin=sin, cos=cos)
  latent, k_pe = _latents(p, h, cfg, sin=sin, cos=cos)
  w_uk = _kv_b(p)[..., :cfg.mla.qk_nope_head_dim].astype(cfg.compute_dtype)
  q_latent = jnp.einsum("bthk,rhk->bthr", q_nope, w_uk)
  return jnp.concatenate([q_latent, q_pe], axis=-1), jnp.concatenate([latent[:, :, None], k_pe], axis=-1)


def latent_values(p: Params, attended: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Each head's values [B, T, H, Kv] from its attended latent [B, T, H, C]: the absorbed form's W_UV."""
  w_uv = _kv_b(p)[..., cfg.mla.qk_nope_head_dim:].astype(cfg.compute_dtype)
  return jnp.einsum("bthr,rhv->bthv", attended, w_uv)


def _queries(p: Params, h: jax.Array, cfg: ModelConfig, *, sin: jax.Array,
             cos: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each head's query parts without and with positions: q_nope [B, T, H, Kn] and RoPE'd q_pe [B, T, H, K]."""
  mla, dtype = cfg.mla, cfg.compute_dtype
  if mla.q_lora_rank:
    q_latent = rms_norm(lora.project("btd,dr->btr", h, p["q_a"], dtype), p["q_a_norm"], cfg)
    q = lora.project("btr,rhk->bthk", q_latent, p["q_b"], dtype)
  else:
    q = lora.project("btd,dhk->bthk", h, p["q"], dtype)
  q_nope, q_pe = jnp.split(q, [mla.qk_nope_head_dim], axis=-1)
  return q_nope, rope.apply_rope(q_pe, sin, cos)


def _latents(p: Params, h: jax.Array, cfg: ModelConfig, *, sin: jax.Array,
             cos: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each token's normed latent c [B, T, C] and its RoPE'd key part k_pe [B, T, 1, K], shared by every head."""
  latent, k_pe = jnp.split(lora.project("btd,dr->btr", h, p["kv_a"], cfg.compute_dtype), [cfg.mla.kv_lora_rank],
                           axis=-1)
  return rms_norm(latent, p["kv_a_norm"], cfg), rope.apply_rope(k_pe[:, :, None], sin, cos)


def _kv_b(p: Params) -> jax.Array:
  """One layer's kv_b [C, H, Kn + Kv] as a plain array: the absorbed form folds it into queries and outputs.

  Raises:
    TypeError: for a LoRA-adapted or int8 kv_b (merge adapters first; rollout weights keep kv_b float).
  """
  w = p["kv_b"]
  if not isinstance(w, jax.Array):
    raise TypeError(f"model.mla: the absorbed decode reads kv_b as a plain array, got a {type(w).__name__}; merge "
                    "LoRA adapters into the weights first (ptx.models.lora.merge)")
  return w


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
