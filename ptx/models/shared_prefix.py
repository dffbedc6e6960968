"""Logits of grouped rollouts with each group's shared prompt computed once.

GRPO scores G completions of every prompt, so a rollout batch holds each
prompt G times. Under causal attention a prompt's hidden states do not depend
on what follows it, so running it once per group and letting the G
completions attend to its keys and values gives the same logits (and, through
the shared K/V, the same gradients) as the plain forward over [prompt,
completion] rows, at (P + G N) / (G (P + N)) of the tokens: 288 of 384 for
the CPU anchor's 4 x 4 rollouts of 32 + 64 tokens.

The mechanism is the sampler's, `prefill_groups`: the prompts fill a KV
cache (`ptx.models.kv_cache`), `kv_cache.repeat` hands each prompt's cache
to its G rows, and the completions run against it
(`decoder.forward_with_cache`).
The cache attention is differentiable when the rollout fits one attention
block (`fits`); `rollout_logits` takes the plain forward for longer
rollouts, for ring attention (long contexts shard the sequence, not a cache)
and when the caller cannot promise whole groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ptx import sharding
from ptx.config import ModelConfig
from ptx.models import kv_cache
from ptx.models.decoder import Params, forward, forward_with_cache


def fits(prompt_len: int, seq_len: int) -> bool:
  """Whether rollouts of `seq_len` columns, `prompt_len` of them prompt, can share their prefixes."""
  return 0 < prompt_len < seq_len <= kv_cache.BLOCK_SLOTS


def prefill_groups(params: Params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, cache: kv_cache.KVCache,
                   cfg: ModelConfig, group_size: int, chunk: int, rules: sharding.Rules = sharding.DEFAULT_RULES
                   ) -> tuple[jax.Array, kv_cache.KVCache]:
  """Writes B left-padded prompts [B, P] into the cache `chunk` columns at a time, then gives each to G rows.

  Returns:
    (float32 logits [B * G, V] of each prompt's last token, the cache of
    B * G rows, row b * G + g holding prompt b).
  """
  B, P = prompt_tokens.shape
  chunk = min(chunk, P)
  # Padding columns get position 0; their slots lie before the row's start and are never attended to.
  positions_BP = jnp.maximum(jnp.arange(P, dtype=jnp.int32)[None, :] - (P - prompt_lengths)[:, None], 0)

  def run(first: jax.Array | int, cache: kv_cache.KVCache) -> tuple[jax.Array, kv_cache.KVCache]:
    columns = lambda x: jax.lax.dynamic_slice_in_dim(x, first, chunk, axis=1)  # noqa: E731
    return forward_with_cache(params, columns(prompt_tokens), cfg, cache, positions=columns(positions_BP),
                              last_only=True, rules=rules)

  # Only the last chunk's logits are used; the loop's are dead code.
  cache = jax.lax.fori_loop(0, P // chunk - 1, lambda i, cache: run(i * chunk, cache)[1], cache)
  logits_B1V, cache = run(P - chunk, cache)
  return jnp.repeat(logits_B1V[:, 0], group_size, axis=0), kv_cache.repeat(cache, group_size, rules)


def rollout_logits(
    params: Params,
    batch: dict[str, jax.Array],
    cfg: ModelConfig,
    *,
    group_size: int,
    prompt_len: int | None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> jax.Array:
  """Logits [R, S, V] of a rollout batch (`tokens`, `positions`, `segment_ids`) for an RL loss.

  With `prompt_len` set, the batch's rows are whole groups of `group_size`
  sharing their first `prompt_len` columns, and where that pays and is
  supported the prompts run once per group (`grouped_logits`); otherwise, and
  with `prompt_len` None, this is `forward`.
  """
  tokens, positions, segment_ids = batch["tokens"], batch["positions"], batch["segment_ids"]
  if (prompt_len is None or group_size == 1 or cfg.attention_impl == "ring"
      or not fits(prompt_len, tokens.shape[1])):
    return forward(params, tokens, cfg, positions=positions, segment_ids=segment_ids, rules=rules)
  return grouped_logits(params, tokens, positions, segment_ids, cfg, group_size=group_size, prompt_len=prompt_len,
                        rules=rules)


def grouped_logits(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    cfg: ModelConfig,
    *,
    group_size: int,
    prompt_len: int,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> jax.Array:
  """float32 logits [R, S, V] as `forward` gives them at every column that predicts a completion token.

  Args:
    params: the parameter tree.
    tokens: int32 [R, S]: R = B * G rows, row b * G + g the g-th rollout of
      prompt b; columns [0, P) the left-padded prompt (identical within a
      group), then the completion.
    positions: int32 [R, S] positions: 0 on prompt padding, then counting
      from each prompt's first token (the prompt's own are derived from its
      length, as the sampler derives them).
    segment_ids: int32 [R, S]; 0 marks padding (prompt padding is read from
      the group's first row).
    cfg: the model config.
    group_size: G.
    prompt_len: P, the prompt columns.
    rules: the sharding rules.

  Returns:
    Logits [R, S, V]: columns P - 1 .. S - 1 equal the plain forward's; the
    prompt columns before P - 1 predict prompt tokens, which no RL loss
    scores, and are zero.
  """
  R, S = tokens.shape
  G, P = group_size, prompt_len
  if R % G:
    raise ValueError(f"grouped_logits: {R} rows do not split into groups of {G}")
  if not fits(P, S):
    raise ValueError(f"grouped_logits: a rollout of {S} columns with a {P}-column prompt does not fit one "
                     f"attention block of {kv_cache.BLOCK_SLOTS} slots (check `fits` first)")
  prompt_lengths = jnp.sum(segment_ids[::G, :P] != 0, axis=1)
  cache = kv_cache.init_cache(cfg, R // G, S, starts=P - prompt_lengths, rules=rules)
  last_RV, cache = prefill_groups(params, tokens[::G, :P], prompt_lengths, cache, cfg, G, P, rules)
  completion_RNV, _ = forward_with_cache(params, tokens[:, P:], cfg, cache, positions=positions[:, P:], rules=rules)
  unscored = jnp.zeros((R, P - 1, completion_RNV.shape[-1]), completion_RNV.dtype)
  return jnp.concatenate([unscored, last_RV[:, None], completion_RNV], axis=1)
