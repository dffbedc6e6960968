"""A lower bound on one device's memory for a sequence-parallel training step.

Long-context memory is judged against what the step cannot avoid holding,
counted per device for a batch of `batch` sequences of `seq_len` tokens whose
sequence axis is split over `seq_shards` devices (ring attention), with every
layer rematerialised (`remat="full"`) and the loss projected in chunks:

  state        parameters, gradients and two Adam moments (float32)
  checkpoints  the residual stream at each layer's input, saved for the backward
  layer        one layer's backward inputs: attention q, k, v, out and lse, the
               MLP's gate and up pre-activations (a Mixture of Experts': those
               of the k routed experts and the shared ones), and the
               residual-stream gradient in and out
  kv_blocks    ring attention's K/V blocks in flight for one head pass (the
               block being used and the one arriving) and, in the backward,
               the travelling float32 dK/dV of the same heads
  logits       one chunk's float32 logits and their gradient

Everything but the state is per token and divided by the shards, so the floor
is flat in tokens per device. A GRPO update (`grpo_floor_bytes`) holds the
same plus its own:

  reference    the frozen reference parameters, when the KL needs them
  rollout      the rollouts' per-token arrays: tokens, positions, segments and
               loss mask (int32), and the sampler's, old and reference
               log-probs and the aggregation weights (float32)
"""

from __future__ import annotations

from ptx.model_config import ModelConfig
from ptx.models.params import count_params


def training_floor_bytes(cfg: ModelConfig, *, batch: int, seq_len: int, seq_shards: int) -> dict[str, int]:
  """The floor's parts in bytes per device (module docstring), plus their `total`."""
  tokens = batch * seq_len // seq_shards
  act = 2 if cfg.compute_dtype == "bfloat16" else 4
  n_params = count_params(cfg)
  kv_per_pass = max((cfg.ring_heads_per_pass or cfg.n_heads // cfg.n_kv_heads) * cfg.n_kv_heads // cfg.n_heads, 1)
  chunk = min(cfg.logits_chunk or tokens, tokens)  # tokens per device in one chunk of the vocabulary projection
  parts = {
      "state": 4 * n_params * 4,
      "checkpoints": cfg.n_layers * tokens * cfg.d_model * act,
      # q and k at the query/key width, v and out at the value width (they differ under MLA).
      "layer": tokens * act * ((cfg.n_heads + cfg.n_kv_heads) * (cfg.qk_head_dim + cfg.v_head_dim)
                               + 2 * _mlp_width(cfg) + 2 * cfg.d_model) + tokens * cfg.n_heads * 4,
      "kv_blocks": tokens * kv_per_pass * (cfg.qk_head_dim + cfg.v_head_dim) * (2 * act + 2 * 4),
      "logits": 2 * chunk * cfg.vocab_size * 4,
  }
  return {**parts, "total": sum(parts.values())}


def _mlp_width(cfg: ModelConfig) -> int:
  """The MLP hidden units one token runs through in the widest layer: the dense MLP's, or its k experts' and the
  shared ones' (or the dense layers' of a Mixture of Experts that has some, when wider)."""
  moe = cfg.moe
  if not moe.enabled:
    return cfg.mlp_dim
  routed = moe.experts_per_token * moe.expert_mlp_dim + moe.shared_mlp_dim
  return max(routed, cfg.mlp_dim) if moe.dense_layers else routed


def grpo_floor_bytes(cfg: ModelConfig, *, rows: int, seq_len: int, seq_shards: int,
                     with_reference: bool) -> dict[str, int]:
  """The floor of one GRPO update over `rows` rollouts of `seq_len` tokens, in bytes per device, plus `total`."""
  parts = training_floor_bytes(cfg, batch=rows, seq_len=seq_len, seq_shards=seq_shards)
  del parts["total"]
  n_params = count_params(cfg)
  parts["reference"] = n_params * 4 if with_reference else 0
  parts["rollout"] = rows * seq_len // seq_shards * 8 * 4
  return {**parts, "total": sum(parts.values())}
