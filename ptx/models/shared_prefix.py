"""Token log-probs of grouped rollouts with each group's shared prompt computed once.

GRPO scores G completions of every prompt, so a rollout batch holds each
prompt G times. Under causal attention a prompt's hidden states do not depend
on what follows it, so running it once per group and letting the G
completions attend to its keys and values gives the same log-probs (and,
through the shared K/V, the same gradients) as the plain forward over
[prompt, completion] rows, at (P + G N) / (G (P + N)) of the tokens: 288 of
384 for 4 x 4 rollouts of 32 + 64 tokens.

The mechanism is the sampler's, `prefill_groups`: the prompts fill a KV
cache (`ptx.models.kv_cache`) that each prompt's G rows read, and the
completions run against it (`decoder.hidden_with_cache`), their hidden
states projected to the vocabulary in chunks (`chunked_logits.project`).
Prompts of SHARED_PREFIX_MIN_SLOTS columns or more stay one copy per prompt, which the
rows share as their prefix (`kv_cache.share_prefix`); shorter ones are
copied to each row (`kv_cache.repeat`), where one attention pass over
prompt and completion costs less than two passes and their merge.
The cache attention is differentiable when the prompts and the completions
each fit one attention block (`fits`); `rollout_stats` takes the plain
forward (`chunked_logits.token_stats`) for longer rollouts, when the caller
cannot promise whole groups, for any attention but "xla" (the cache attends
through the decode kernel, dense over blocks of slots like "xla": a model
configured for blockwise, Pallas or ring attention runs that one), and under
remat. The cache path runs its layers
as the cache holds them (`kv_cache.decode_scans`: unrolled over one cache
array per layer on XLA:CPU, scanned over a stacked cache elsewhere), and
unrolled, remat saved nothing measurable there: its compiled update grew by
~145 MiB a layer with remat as without, where the scanned forward grows by
1.5 (XLA:CPU, 8 devices; benchmarks/RESULTS.md), so a rematerialised model,
which needs its memory, takes the scanned plain forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models import kv_cache, moe
from ptx.models.attention import resolve
from ptx.models.chunked_logits import TokenStats, logit_stats, project, token_stats
from ptx.models.decoder import Params, hidden_with_cache, unembed


# Prompt columns from which a group's rows share one copy of their prompt's K/V rather than each holding one:
# shorter prompts are cheaper copied (one attention pass, no merge), and the copies' memory grows with G * P.
SHARED_PREFIX_MIN_SLOTS = 64


def shares_prompt_cache(group_size: int, prompt_len: int, shared_prompts: bool | None = None) -> bool:
  """Whether `prefill_groups` keeps one copy of each prompt's K/V for its G > 1 rows (else one per row).

  `shared_prompts` decides when given; None: prompts of at least
  SHARED_PREFIX_MIN_SLOTS columns are shared.
  """
  if group_size == 1:
    return False
  return prompt_len >= SHARED_PREFIX_MIN_SLOTS if shared_prompts is None else shared_prompts


def fits(prompt_len: int, seq_len: int, group_size: int, shared_prompts: bool | None = None) -> bool:
  """Whether rollouts of `seq_len` columns, `prompt_len` of them prompt, can share their prefixes.

  The cache attention is differentiable over one block of
  `kv_cache.BLOCK_SLOTS` slots: copied prompts need the whole rollout to fit
  one, shared prompts (`shares_prompt_cache`) the prompt and the completion
  one each.
  """
  if not 0 < prompt_len < seq_len:
    return False
  if shares_prompt_cache(group_size, prompt_len, shared_prompts):
    return max(prompt_len, seq_len - prompt_len) <= kv_cache.BLOCK_SLOTS
  return seq_len <= kv_cache.BLOCK_SLOTS


def prefill_groups(params: Params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, cfg: ModelConfig,
                   group_size: int, *, new_slots: int, chunk: int | None = None, kv_int8: bool = False,
                   slot_multiple: int = 1, shared_prompts: bool | None = None,
                   rules: sharding.Rules = sharding.DEFAULT_RULES,
                   routes: jax.Array | None = None) -> tuple[jax.Array, kv_cache.KVCache, jax.Array | None]:
  """Prefills B left-padded prompts [B, P] once each into a KV cache that their G rows read.

  Args:
    params: the parameter tree.
    prompt_tokens: int32 [B, P], each prompt right-aligned.
    prompt_lengths: int32 [B], each in 1..P.
    cfg: the model config.
    group_size: rows per prompt G.
    new_slots: slots each row gets for the tokens after its prompt.
    chunk: prefill this many columns at a time (divides P); None: all P.
    kv_int8: store K/V as int8 (`kv_cache.init_cache`).
    slot_multiple: round cache sizes up to a multiple of this (the devices
      along `seq`).
    shared_prompts: one copy of each prompt's K/V for its rows (True), a
      copy per row (False), or by prompt length (None, `shares_prompt_cache`).
    rules: sharding rules.
    routes: `moe.ROUTE_DTYPE` [B, P, L, k] experts of the prompt tokens to replay; None: the routers choose.

  Returns:
    (float32 logits [B * G, V] of each prompt's last token, the cache of
    B * G rows, row b * G + g reading prompt b, the experts the prompts' tokens
    used: [B, P, L, k], `moe.NO_ROUTE` on padding; None for a dense model). A
    row's first new token goes to slot 0 of its own slots when the prompts are
    shared (`shares_prompt_cache`: the cache has a `prefix`), else to slot P.
  """
  B, P = prompt_tokens.shape
  chunk = min(chunk or P, P)
  shared = shares_prompt_cache(group_size, P, shared_prompts)
  round_up = lambda n: -(-n // slot_multiple) * slot_multiple  # noqa: E731
  cache = kv_cache.init_cache(cfg, B, round_up(P if shared else P + new_slots), starts=P - prompt_lengths,
                              int8=kv_int8, rules=rules)
  # Padding columns get position 0; their slots lie before the row's start and are never attended to.
  positions_BP = jnp.maximum(jnp.arange(P, dtype=jnp.int32)[None, :] - (P - prompt_lengths)[:, None], 0)

  def run(first: jax.Array | int, cache: kv_cache.KVCache, used: jax.Array | None):
    columns = lambda x: jax.lax.dynamic_slice_in_dim(x, first, chunk, axis=1)  # noqa: E731
    x, cache, trace = hidden_with_cache(params, columns(prompt_tokens), cfg, cache, positions=columns(positions_BP),
                                        rules=rules, routes=None if routes is None else columns(routes))
    if used is not None:
      used = jax.lax.dynamic_update_slice_in_dim(used, trace.routes, first, axis=1)
    return unembed(params, x[:, -1:], cfg, rules), cache, used

  used = moe.no_routes(B, P, cfg) if cfg.moe.enabled else None
  # Only the last chunk's logits are used; the loop's are dead code.
  cache, used = jax.lax.fori_loop(0, P // chunk - 1, lambda i, carry: run(i * chunk, *carry)[1:], (cache, used))
  logits_B1V, cache, used = run(P - chunk, cache, used)
  if used is not None:  # the padding columns' routes, of pad tokens no real token attends to, are not recorded
    padding = jnp.arange(P)[None, :] < (P - prompt_lengths)[:, None]
    used = jnp.where(padding[:, :, None, None], moe.NO_ROUTE, used)
  logits_RV = jnp.repeat(logits_B1V[:, 0], group_size, axis=0)
  if shared:
    return logits_RV, kv_cache.share_prefix(cache, group_size, round_up(new_slots), rules), used
  return logits_RV, kv_cache.repeat(cache, group_size, rules), used


def rollout_stats(
    params: Params,
    batch: dict[str, jax.Array],
    cfg: ModelConfig,
    *,
    group_size: int,
    prompt_len: int | None,
    temperature: float = 1.0,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> tuple[TokenStats, moe.Trace]:
  """Per-token log-probs and entropies [R, S] of a rollout batch (`tokens`, `positions`, `segment_ids`) for an RL loss.

  Index t scores token t at `temperature` (index 0 is 0). With `prompt_len`
  set, the batch's rows are whole groups of `group_size` sharing their first
  `prompt_len` columns, and where that pays and is supported (module
  docstring) the prompts run once per group (`grouped_stats`); otherwise, and
  with `prompt_len` None, this is `chunked_logits.token_stats`. Both project to the vocabulary in
  chunks of `cfg.logits_chunk` tokens. The second result is the MoE layers' trace: statistics of every token, or
  with prompts run once per group, of the completion columns; the experts of every token. A batch with `routes`
  ([R, S, L, k], `moe.ROUTE_DTYPE`) replays them (routing replay).
  """
  tokens, positions, segment_ids = batch["tokens"], batch["positions"], batch["segment_ids"]
  routes = batch.get("routes")
  impl = resolve(cfg.attention_impl, q_len=tokens.shape[1], kv_len=tokens.shape[1], head_dim=cfg.qk_head_dim,
                 v_head_dim=cfg.v_head_dim, rules=rules)
  if (prompt_len is None or group_size == 1 or impl != "xla" or cfg.remat != "none"
      or not fits(prompt_len, tokens.shape[1], group_size)):
    return token_stats(params, tokens, cfg, positions=positions, segment_ids=segment_ids, rules=rules,
                       temperature=temperature, routes=routes)
  return grouped_stats(params, tokens, positions, segment_ids, cfg, group_size=group_size, prompt_len=prompt_len,
                       temperature=temperature, rules=rules, routes=routes)


def grouped_stats(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    cfg: ModelConfig,
    *,
    group_size: int,
    prompt_len: int,
    temperature: float = 1.0,
    shared_prompts: bool | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    routes: jax.Array | None = None,
) -> tuple[TokenStats, moe.Trace]:
  """TokenStats [R, S] as `token_stats` gives them at every completion column, each prompt run once per group.

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
    temperature: score under softmax(logits / temperature).
    shared_prompts: as in `prefill_groups`.
    rules: the sharding rules.
    routes: `moe.ROUTE_DTYPE` [R, S, L, k] experts to replay (a group's prompt
      columns read from its first row); None: the routers choose.

  Returns:
    (TokenStats [R, S]: columns P .. S - 1 (the completion tokens) equal
    `token_stats`'; the prompt columns, which no RL loss scores, are zero;
    the MoE layers' trace: statistics over the completion columns, the
    experts of every column).
  """
  R, S = tokens.shape
  G, P = group_size, prompt_len
  if R % G:
    raise ValueError(f"grouped_stats: {R} rows do not split into groups of {G}")
  if not fits(P, S, G, shared_prompts):
    raise ValueError(f"grouped_stats: a rollout of {S} columns with a {P}-column prompt does not fit one attention "
                     f"block of {kv_cache.BLOCK_SLOTS} slots (the prompt and the completion one each when prompts "
                     f"are shared; check `fits` first)")
  prompt_lengths = jnp.sum(segment_ids[::G, :P] != 0, axis=1)
  last_RV, cache, prompt_routes = prefill_groups(params, tokens[::G, :P], prompt_lengths, cfg, G, new_slots=S - P,
                                                 shared_prompts=shared_prompts, rules=rules,
                                                 routes=None if routes is None else routes[::G, :P])
  x_RND, _, trace = hidden_with_cache(params, tokens[:, P:], cfg, cache, positions=positions[:, P:], rules=rules,
                                      routes=None if routes is None else routes[:, P:])
  if trace.routes is not None:
    trace = trace._replace(routes=jnp.concatenate([jnp.repeat(prompt_routes, G, axis=0), trace.routes], axis=1))
  # The prompt's last column predicts the first completion token; completion column t the token after it
  # (the last column's target is a dummy, dropped).
  first = logit_stats(last_RV[:, None], tokens[:, P:P + 1], temperature)
  targets = jnp.concatenate([tokens[:, P + 1:], jnp.zeros((R, 1), tokens.dtype)], axis=1)
  rest = project(params, x_RND, targets, cfg, rules, temperature)
  unscored = lambda a: jnp.zeros((R, P), a.dtype)
  return TokenStats(*(jnp.concatenate([unscored(f), f, r[:, :-1]], axis=1) for f, r in zip(first, rest))), trace
