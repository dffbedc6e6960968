"""Per-token log-probabilities without [tokens, vocab] logits: the output projection in chunks.

A loss over T tokens needs, per token, the log-probability of that token (and
for some losses the argmax hit and the entropy), never the [B, T, V] logits.
`token_stats` runs the decoder to its last hidden state and `project` maps it
to the vocabulary `cfg.logits_chunk` tokens per device at a time inside a
rematerialised scan: the backward recomputes each chunk's logits, so memory
holds one chunk's [chunk, V] per device instead of every token's.

A chunk takes the same positions from every row and every sequence shard, so
all devices project at once and no activation moves between them: each row
contributes chunk / (rows per device) positions of each shard, and a shard's
positions are padded to a whole number of chunks (the padding is scored and
dropped). With ring attention in the zig-zag layout (`cfg.seq_layout`) the
tokens are reordered once before the layers (positions stay global) and the
per-token results reordered back, so callers always see the natural order.

SFT's and DPO's losses, GRPO's loss, its behaviour and reference log-probs
(`ptx.models.shared_prefix.rollout_stats`) all score through `project`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ptx_kernels

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models.attention import resolve, sequence_shards
from ptx.models.attention_choice import RowLayout
from ptx.models import moe
from ptx.models import vision
from ptx.models.decoder import Params, hidden_states, tempered, token_log_probs, unembed


class TokenStats(NamedTuple):
  """Per-token results [B, T], index t scoring token t given tokens < t (index 0 is 0)."""

  log_probs: jax.Array  # float32 log p(token t | tokens < t)
  correct: jax.Array  # bool: token t is the argmax of its prediction
  entropy: jax.Array  # float32 entropy of the distribution that predicts token t


def token_stats(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    temperature: float = 1.0,
    routes: jax.Array | None = None,
    rows: RowLayout = "packed",
    images: vision.Images | None = None,
) -> tuple[TokenStats, moe.Trace]:
  """Runs the decoder on int32 tokens [B, T] and scores every next token, `cfg.logits_chunk` at a time.

  Args:
    params: the model's parameter tree.
    tokens: int32 token ids [B, T].
    cfg: the model config (`logits_chunk`, `attention_impl`, `seq_layout`).
    positions: int32 [B, T]; defaults to 0..T-1 on every row.
    segment_ids: int32 [B, T]; defaults to one segment per row.
    rules: the sharding rules for activation constraints.
    temperature: score under softmax(logits / temperature) (log-probs and
      entropy; the argmax does not move).
    routes: `moe.ROUTE_DTYPE` [B, T, L, k] experts to replay (`decoder.hidden_states`); None: the routers choose.
    rows: what `segment_ids` hold (`ptx.models.attention_choice.RowLayout`).
    images: image features and their slots (`ptx.models.vision.Images`); None: text only.

  Returns:
    (TokenStats of [B, T] arrays in the natural token order, the MoE layers' trace (`moe.Trace`), its routes and
    dropped tokens in the natural order too).
  """
  B, T = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  if segment_ids is None:
    segment_ids = jnp.ones((B, T), jnp.int32)
  # Position t predicts token t + 1; the last position's target is a dummy.
  targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
  reorder, restore = _ring_order(cfg, rules, T)
  x, trace = hidden_states(params, reorder(tokens), cfg, positions=reorder(positions),
                           segment_ids=reorder(segment_ids), rules=rules,
                           routes=None if routes is None else reorder(routes), rows=rows,
                           images=None if images is None else images._replace(slots=reorder(images.slots)))
  stats = project(params, x, reorder(targets), cfg, rules, temperature)
  trace = trace._replace(routes=None if trace.routes is None else restore(trace.routes),
                         dropped=None if trace.dropped is None else restore(trace.dropped))
  # Shift by one so index t scores token t.
  return TokenStats(*(jnp.pad(restore(s)[:, :-1], ((0, 0), (1, 0))) for s in stats)), trace


def project(params: Params, x_BTD: jax.Array, targets_BT: jax.Array, cfg: ModelConfig,
            rules: sharding.Rules = sharding.DEFAULT_RULES, temperature: float = 1.0) -> TokenStats:
  """Scores targets [B, T] under the hidden states x [B, T, D], `cfg.logits_chunk` tokens per device at a time.

  Unlike `token_stats`, index t scores targets[:, t] as the prediction of position t.
  """
  B, T, D = x_BTD.shape
  shards = _shards(x_BTD.shape, 1, rules)
  local_rows = -(-B // _shards(x_BTD.shape, 0, rules))
  local_len = T // shards
  if cfg.logits_chunk == 0 or local_rows * local_len <= cfg.logits_chunk:
    return _stats(params, x_BTD, targets_BT, cfg, rules, temperature)
  m = -(-local_len // max(cfg.logits_chunk // local_rows, 1))  # chunks
  length = -(-local_len // m)  # positions per row and shard in one chunk, balanced so padding stays < m
  pad = m * length - local_len

  def split(a):
    # [B, T] -> [B, shards, local_len] (the shard layout kept) -> padded -> [m, B, shards * length]:
    # chunk j holds positions j * length .. of every shard.
    a = a.reshape((B, shards, local_len) + a.shape[2:])
    a = jnp.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3))
    return jnp.moveaxis(a.reshape((B, shards, m, length) + a.shape[3:]), 2, 0).reshape(
        (m, B, shards * length) + a.shape[3:])

  @jax.checkpoint
  def one_chunk(_, xs):
    x, targets = xs
    x = sharding.constrain(x, ("batch", "seq", "embed"), rules)
    return None, _stats(params, x, targets, cfg, rules, temperature)

  _, stats = jax.lax.scan(one_chunk, None, (split(x_BTD), split(targets_BT)))
  merge = lambda a: jnp.moveaxis(a.reshape(m, B, shards, length), 0, 2).reshape(B, shards, m * length)[
      :, :, :local_len].reshape(B, T)
  return TokenStats(*(merge(s) for s in stats))


def logit_stats(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> TokenStats:
  """TokenStats of integer targets [..., T] under float32 logits [..., T, V] at `temperature`."""
  logits = tempered(logits.astype(jnp.float32), temperature)
  logp = jax.nn.log_softmax(logits, axis=-1)
  entropy = -(jnp.exp(logp) * logp).sum(axis=-1)
  return TokenStats(token_log_probs(logits, targets), jnp.argmax(logits, axis=-1) == targets, entropy)


def _stats(params: Params, x: jax.Array, targets: jax.Array, cfg: ModelConfig, rules: sharding.Rules,
           temperature: float) -> TokenStats:
  """TokenStats of targets under the full logits of x."""
  return logit_stats(unembed(params, x, cfg, rules), targets, temperature)


def _shards(shape: tuple[int, ...], dim: int, rules: sharding.Rules) -> int:
  """How many devices the activation rules shard dimension `dim` (0 batch, 1 sequence) of [B, T, D] over."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  axes = sharding.logical_to_spec(("batch", "seq", "embed"), rules, shape=shape, mesh=mesh)[dim]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def _ring_order(cfg: ModelConfig, rules: sharding.Rules, length: int):
  """(reorder, restore) of the sequence axis of [B, T] arrays for ring attention's layout."""
  identity = lambda a: a
  impl = resolve(cfg.attention_impl, q_len=length, kv_len=length, head_dim=cfg.qk_head_dim,
                 v_head_dim=cfg.v_head_dim, rules=rules)
  n = sequence_shards(rules)
  if impl != "ring" or cfg.seq_layout != "zigzag" or n == 1:
    return identity, identity
  if length % (2 * n):
    raise ValueError(f"model.seq_layout='zigzag' needs the sequence length ({length}) to be a multiple of "
                     f"2 x {n} sequence shards")
  return (lambda a: ptx_kernels.to_zigzag(a, n, axis=1)), (lambda a: ptx_kernels.from_zigzag(a, n, axis=1))
