"""Supervised fine-tuning: masked next-token cross-entropy, packing-aware.

Token t predicts token t + 1 when both belong to the same non-padding segment
and token t + 1 is a target (`loss_mask`). So no loss crosses a packed
segment boundary, and the attention mask (segment ids) keeps segments apart.
The log-probabilities come from `chunked_logits.token_stats`, which projects
to the vocabulary `model.logits_chunk` tokens at a time (and runs ring
attention's sequence layout) so long sequences never build [B, T, V] logits.

A batch with images (`pixel_values` [B, N, 3, S, S] and `image_slots` [B, T],
`ptx.data.batch`) runs the vision tower on its tiles first, and each image
token takes its feature row (`ptx.models.vision`); image tokens are never
targets (their loss mask is 0, `ptx.data.image_chat`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models import moe, vision
from ptx.models.attention_choice import RowLayout
from ptx.models.chunked_logits import token_stats

Batch = dict[str, jax.Array]


def next_token_targets(batch: Batch) -> tuple[jax.Array, jax.Array]:
  """Returns (targets [B, T-1], float32 weights [B, T-1]) for the shifted batch."""
  seg = batch["segment_ids"]
  same_segment = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
  weights = (batch["loss_mask"][:, 1:] != 0) & same_segment
  return batch["tokens"][:, 1:], weights.astype(jnp.float32)


def loss(
    params: Any,
    batch: Batch,
    rng: jax.Array,
    *,
    model: ModelConfig,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    rows: RowLayout = "packed",
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean next-token cross-entropy over the target tokens of `batch` (+ a Mixture of Experts' auxiliary losses).

  Args:
    params: the model's parameter tree.
    batch: int32 [B, T] `tokens`, `loss_mask`, `segment_ids`, `positions`; with images also `image_slots` and
      `pixel_values` (`ptx.data.batch`).
    rng: unused (SFT is deterministic); part of the loss-function contract.
    model: the model config.
    rules: sharding rules for activation constraints.
    rows: what the batch's segment ids hold (`DataConfig.rows`; `ptx.models.attention_choice.RowLayout`).

  Returns:
    (loss, metrics): `loss` (the cross-entropy), `accuracy` (argmax ==
    target) and `weight` (the number of target tokens, by which the trainer
    weights micro-batches; a token whose predicting position had an MoE copy
    dropped is none, `moe.undropped`); for a Mixture of Experts `moe/...` statistics
    (`ptx.models.moe.metrics`), their auxiliary losses added to the value
    optimised with `model.moe_balance_coef` and `model.moe_z_coef`.
  """
  del rng
  images = None
  if "pixel_values" in batch:  # static: the batch's structure (data.tiles_per_row > 0)
    images = vision.Images(vision.encode_images(params, batch["pixel_values"], model, rules), batch["image_slots"])
  stats, trace = token_stats(params, batch["tokens"], model, positions=batch["positions"],
                             segment_ids=batch["segment_ids"], rules=rules, rows=rows, images=images)
  weights = moe.undropped(next_token_targets(batch)[1], trace)
  n_tokens = weights.sum()
  denominator = jnp.maximum(n_tokens, 1.0)  # an all-masked micro-batch contributes 0
  mean_nll = -(stats.log_probs[:, 1:] * weights).sum() / denominator
  accuracy = (stats.correct[:, 1:] * weights).sum() / denominator
  metrics = {"loss": mean_nll, "accuracy": accuracy, "weight": n_tokens, **moe.metrics(trace.stats)}
  return mean_nll + moe.aux_loss(trace.stats, model), metrics
