"""The rollout engine's device programs: prefill, decode, verify, speculate, copy over pages, and the pairs they read.

A `Programs` set jits each once and compiles it once per shape bucket (the
host side, `ptx.sampling.engine.engine`, packs its rows into power-of-two
buckets); every engine runs the `SHARED` set unless given its own, which its
owner can `release`. Every program donates the pool it writes. Speculate
takes its drafting as one static `drafting.DeviceDrafter` (how rows draft,
how their drafts are accepted), and a draft model's parameters as an
argument beside it.
With the static `record_routes` (a Mixture-of-Experts model, for routing
replay) prefill, decode, verify and speculate also return the experts each
MoE layer chose for every token they fed (`moe.ROUTE_DTYPE` [rows, columns,
L, k]); without it they compile what they compiled before.
`init_pool_program` gives the pool's allocation, compiled once per shape and
placement, however many engines are built (a multi-turn GRPO job builds one
per step).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from ptx_kernels.implementation import Kernel

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models import moe, paged_kv_cache
from ptx.models.decoder import Params, decode_params, hidden_with_cache, tempered, token_log_probs, unembed
from ptx.sampling import buckets
from ptx.sampling.engine import map_budget
from ptx.sampling.engine.drafters import DeviceDrafter
from ptx.sampling.generation import LENGTH, STOP
from ptx.sampling.rules import SamplingConfig, sample_tokens
from ptx.sampling.engine.acceptance import accept_deterministic, uniforms

log = logging.getLogger(__name__)


class DecodeRows(NamedTuple):
  """Every slot's inputs to a decode call (R rows)."""

  page_table: jax.Array  # int32 [R, M]
  lengths: jax.Array  # int32 [R]: cached positions
  pending: jax.Array  # int32 [R]: the token the first step feeds
  live: jax.Array  # bool [R]
  remaining: jax.Array  # int32 [R]: tokens the row may still sample
  stop_ids: jax.Array  # int32 [R, K], padded with -1
  seq_ids: jax.Array  # int32 [R]
  sampled: jax.Array  # int32 [R]: tokens sampled so far (the RNG counter)
  pairs: paged_kv_cache.Pairs  # the pages each row reads, up to what the call can fill


class Decoded(NamedTuple):
  """What a decode call sampled."""

  tokens: jax.Array  # int32 [R, steps]; pad after a row's emitted count
  log_probs: jax.Array  # float32 [R, steps]
  emitted: jax.Array  # int32 [R]
  finish: jax.Array  # int32 [R]: STOP, LENGTH, or 0 for a row still live
  # With record_routes, ROUTE_DTYPE [R, steps, L, k]: column i the experts of the token step i fed (the pending
  # token, then each emitted one but the last); else None.
  routes: jax.Array | None = None


class VerifyRows(NamedTuple):
  """Every drafting call's inputs (R rows, K drafts at most per row)."""

  page_table: jax.Array  # int32 [R, M]
  lengths: jax.Array  # int32 [R]: cached positions
  tokens: jax.Array  # int32 [R, K + 1]: the pending token, then the row's drafts (padded)
  drafts: jax.Array  # int32 [R]: drafts of each row; -1 for a row that takes no part
  seq_ids: jax.Array  # int32 [R]
  sampled: jax.Array  # int32 [R]: tokens sampled so far (the RNG counter)
  pairs: paged_kv_cache.Pairs  # the pages each row reads, up to its last draft


class Verified(NamedTuple):
  """What a verify call sampled: row r emits tokens[r, :accepted[r] + 1]."""

  tokens: jax.Array  # int32 [R, K + 1]: the policy's token after each fed one
  log_probs: jax.Array  # float32 [R, K + 1]
  accepted: jax.Array  # int32 [R]: the leading drafts the policy's tokens equal
  routes: jax.Array | None = None  # with record_routes, ROUTE_DTYPE [R, K + 1, L, k]: those of the fed tokens


class SpeculateRows(NamedTuple):
  """Every input of a call of device-drafted verify rounds (R rows)."""

  page_table: jax.Array  # int32 [R, M]
  lengths: jax.Array  # int32 [R]: cached positions
  context: jax.Array  # int32 [R, L]: the cached tokens, then the pending one (at lengths[r]), then room
  live: jax.Array  # bool [R]
  remaining: jax.Array  # int32 [R]: tokens the row may still sample
  drafts: jax.Array  # int32 [R]: drafts per round at most (0: drafting off)
  stop_ids: jax.Array  # int32 [R, S], padded with -1
  seq_ids: jax.Array  # int32 [R]
  sampled: jax.Array  # int32 [R]: tokens sampled so far (the RNG counter)
  pairs: paged_kv_cache.Pairs  # the pages each row reads, up to what the call can fill


class Speculated(NamedTuple):
  """What a call of verify rounds sampled, and how its drafts fared."""

  tokens: jax.Array  # int32 [R, rounds * (K + 1)]; pad after a row's emitted count
  log_probs: jax.Array  # float32 [R, rounds * (K + 1)]
  emitted: jax.Array  # int32 [R]
  finish: jax.Array  # int32 [R]: STOP, LENGTH, or 0 for a row still live
  drafted: jax.Array  # int32 [R]: drafts verified
  accepted: jax.Array  # int32 [R]: drafts emitted
  verifies: jax.Array  # int32 [R]: rounds in which the row could draft (drafting on, room for a draft)
  # With record_routes, ROUTE_DTYPE [R, rounds * (K + 1), L, k]: column c the experts of the token fed before
  # emitted token c (as `Decoded.routes`); else None.
  routes: jax.Array | None = None


def prefill_pages(params: Params, k: tuple, v: tuple, page_table: jax.Array, lengths: jax.Array,
                  new_tokens: jax.Array, pairs: paged_kv_cache.Pairs, tokens: jax.Array, *, cfg: ModelConfig,
                  rules: sharding.Rules, kernel: Kernel | None, record_routes: bool = False) -> tuple:
  """Writes the K/V of tokens [A, C] (the first new_tokens[a] of row a real) at positions lengths[a] + t.

  Returns (k, v), and with `record_routes` the tokens' experts [A, C, L, k] after them.
  """
  cache = paged_kv_cache.PagedKVCache(k=k, v=v, page_table=page_table, lengths=lengths, new_tokens=new_tokens,
                                      pairs=pairs, kernel=kernel)
  positions = lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  _, cache, trace = hidden_with_cache(params, tokens, cfg, cache, positions=positions, rules=rules)
  return (cache.k, cache.v, trace.routes) if record_routes else (cache.k, cache.v)


def decode_pages(params: Params, k: tuple, v: tuple, rows: DecodeRows, key: jax.Array, *, cfg: ModelConfig,
                 sampling: SamplingConfig, steps: int, tempered_log_probs: bool, pad_id: int,
                 rules: sharding.Rules, kernel: Kernel | None,
                 record_routes: bool = False) -> tuple[tuple, tuple, Decoded]:
  """Up to `steps` tokens for every live row: feed its pending token, sample the next, stop at a stop id or budget."""
  params = decode_params(params, cfg)  # once, outside the loop
  R = rows.lengths.shape[0]
  logprob_temperature = sampling.temperature if tempered_log_probs else 1.0
  # Every uniform the call may use, drawn before the loop (threefry is a loop of small ops on CPU): row r's
  # step i takes that of its token sampled + i.
  uniforms_RS = uniforms(key, rows.seq_ids, rows.sampled, steps)

  def step(carry):
    i, k, v, lengths, pending, live, remaining, sampled, out, finish = carry
    cache = paged_kv_cache.PagedKVCache(k=k, v=v, page_table=rows.page_table, lengths=lengths,
                                        new_tokens=live.astype(jnp.int32), pairs=rows.pairs, kernel=kernel)
    logits, cache, routes = _forward(params, pending[:, None], cfg, cache, lengths[:, None], rules, record_routes)
    logits_RV = sharding.constrain(logits[:, 0], ("batch", "vocab"), rules)
    token = sample_tokens(logits_RV, uniforms_RS[:, i], sampling)
    log_prob = token_log_probs(tempered(logits_RV, logprob_temperature)[:, None], token[:, None])[:, 0]
    token, log_prob = jnp.where(live, token, pad_id), jnp.where(live, log_prob, 0.0)
    out = Decoded(tokens=out.tokens.at[:, i].set(token), log_probs=out.log_probs.at[:, i].set(log_prob),
                  emitted=out.emitted + live, finish=out.finish,
                  routes=None if routes is None else out.routes.at[:, i].set(routes[:, 0]))
    stopped = live & jnp.any(token[:, None] == rows.stop_ids, axis=-1)
    exhausted = live & ~stopped & (remaining <= 1)
    finish = jnp.where(stopped, STOP, jnp.where(exhausted, LENGTH, finish))
    return (i + 1, cache.k, cache.v, cache.lengths, jnp.where(live, token, pending), live & ~stopped & ~exhausted,
            remaining - live, sampled + live, out, finish)

  out = Decoded(tokens=jnp.full((R, steps), pad_id, jnp.int32), log_probs=jnp.zeros((R, steps), jnp.float32),
                emitted=jnp.zeros((R,), jnp.int32), finish=jnp.zeros((R,), jnp.int32),
                routes=moe.no_routes(R, steps, cfg) if record_routes else None)
  start = (jnp.zeros((), jnp.int32), k, v, rows.lengths, rows.pending, rows.live, rows.remaining, rows.sampled, out,
           jnp.zeros((R,), jnp.int32))
  carry = jax.lax.while_loop(lambda c: (c[0] < steps) & jnp.any(c[5]), step, start)
  _, k, v, *_, out, finish = carry
  return k, v, out._replace(finish=finish)


def verify_pages(params: Params, k: tuple, v: tuple, rows: VerifyRows, key: jax.Array, *, cfg: ModelConfig,
                 sampling: SamplingConfig, tempered_log_probs: bool, rules: sharding.Rules, kernel: Kernel | None,
                 record_routes: bool = False) -> tuple[tuple, tuple, Verified]:
  """One forward over each row's pending token and drafts: the policy's token after each, and how many drafts hold.

  Row r's tokens go to positions lengths[r] .. lengths[r] + drafts[r], its
  padding to the sink page. The token after fed token j is sampled with the
  uniform of token sampled[r] + j, the one a decode step would use there, so
  the emitted tokens are those decoding draws (`ptx.sampling.engine.acceptance`).
  """
  logits_RTV, cache, routes = _policy_logits(params, k, v, rows, rows.tokens, cfg=cfg, rules=rules, kernel=kernel,
                                             record_routes=record_routes)
  tokens_RT, accepted_R = accept_deterministic(logits_RTV, rows.tokens[:, 1:], jnp.maximum(rows.drafts, 0),
                                               uniforms(key, rows.seq_ids, rows.sampled, rows.tokens.shape[1]),
                                               sampling)
  verified = _verified(logits_RTV, tokens_RT, accepted_R, sampling, tempered_log_probs)
  return cache.k, cache.v, verified._replace(routes=routes)


def speculate_pages(params: Params, k: tuple, v: tuple, rows: SpeculateRows, draft_params: Params | None,
                    key: jax.Array, *, cfg: ModelConfig, drafter: DeviceDrafter, drafts: int, rounds: int,
                    sampling: SamplingConfig, tempered_log_probs: bool, pad_id: int, rules: sharding.Rules,
                    kernel: Kernel | None, record_routes: bool = False) -> tuple[tuple, tuple, Speculated]:
  """Up to `rounds` verify rounds for every live row, drafting on the device: no host round trip between rounds.

  Each round, row r has `drafter` draft up to min(drafts[r], remaining - 1)
  tokens after its context (a draft model's with `draft_params`, None for a
  drafter without parameters). One forward feeds its pending token and
  drafts (`verify_pages`), and `drafter` accepts from the policy's logits;
  the row emits the accepted drafts and one token more, cut after a stop id,
  and its context, length, budget and RNG counter advance by what it
  emitted. Deterministic drafts give the tokens decoding draws
  (`verify_pages`); a draft model's go through the rejection rule with
  uniforms of their own (`ptx.sampling.engine.acceptance`), drawn by token index
  as decoding's are, so neither depends on how rounds fall into calls.
  """
  params = decode_params(params, cfg)  # once, outside the loop
  R, L = rows.context.shape
  K, T, N = drafts, drafts + 1, rounds * (drafts + 1)
  at_T = jnp.arange(T, dtype=jnp.int32)[None]

  def round_(carry):
    i, k, v, lengths, context, live, remaining, sampled, finish, out = carry
    could_R = live & (rows.drafts > 0) & (remaining > 1)
    wanted_R = jnp.where(live, jnp.minimum(rows.drafts, remaining - 1), 0)
    pending_R = jnp.take_along_axis(context, lengths[:, None], axis=1)[:, 0]
    drafts_RK, n_R, q = drafter.draft(draft_params, context, lengths + 1, wanted_R, K, rows.seq_ids, sampled, key,
                                      sampling=sampling, rules=rules)
    fed = VerifyRows(page_table=rows.page_table, lengths=lengths,
                     tokens=jnp.concatenate([pending_R[:, None], drafts_RK], axis=1),
                     drafts=jnp.where(live, n_R, -1), seq_ids=rows.seq_ids, sampled=sampled, pairs=rows.pairs)
    logits_RTV, cache, routes = _policy_logits(params, k, v, fed, fed.tokens, cfg=cfg, rules=rules, kernel=kernel,
                                               record_routes=record_routes)
    tokens_RT, accepted_R = drafter.accept(logits_RTV, drafts_RK, n_R, q, rows.seq_ids, sampled, key,
                                           sampling=sampling)
    verified = _verified(logits_RTV, tokens_RT, accepted_R, sampling, tempered_log_probs)
    stop_RT = jnp.any(tokens_RT[..., None] == rows.stop_ids[:, None], axis=-1) & (at_T <= accepted_R[:, None])
    stopped_R = live & jnp.any(stop_RT, axis=1)
    emitted_R = jnp.where(live, jnp.where(stopped_R, jnp.argmax(stop_RT, axis=1) + 1, accepted_R + 1), 0)
    exhausted_R = live & ~stopped_R & (emitted_R >= remaining)
    # Each row's emitted tokens go to columns emitted .. of the output and after its pending token in its context;
    # the rest to a column past the end, which the scatter drops.
    keep_RT = at_T < emitted_R[:, None]
    R1 = jnp.arange(R)[:, None]
    out_cols = jnp.where(keep_RT, out.emitted[:, None] + at_T, N)
    context_cols = jnp.where(keep_RT, lengths[:, None] + 1 + at_T, L)
    out = Speculated(tokens=out.tokens.at[R1, out_cols].set(tokens_RT, mode="drop"),
                     log_probs=out.log_probs.at[R1, out_cols].set(verified.log_probs, mode="drop"),
                     emitted=out.emitted + emitted_R, finish=out.finish,
                     drafted=out.drafted + jnp.where(live, n_R, 0),
                     accepted=out.accepted + jnp.maximum(emitted_R - 1, 0), verifies=out.verifies + could_R,
                     routes=None if routes is None else out.routes.at[R1, out_cols].set(routes, mode="drop"))
    finish = jnp.where(stopped_R, STOP, jnp.where(exhausted_R, LENGTH, finish))
    return (i + 1, cache.k, cache.v, lengths + emitted_R, context.at[R1, context_cols].set(tokens_RT, mode="drop"),
            live & ~stopped_R & ~exhausted_R, remaining - emitted_R, sampled + emitted_R, finish, out)

  zeros_R = jnp.zeros((R,), jnp.int32)
  out = Speculated(tokens=jnp.full((R, N), pad_id, jnp.int32), log_probs=jnp.zeros((R, N), jnp.float32),
                   emitted=zeros_R, finish=zeros_R, drafted=zeros_R, accepted=zeros_R, verifies=zeros_R,
                   routes=moe.no_routes(R, N, cfg) if record_routes else None)
  start = (jnp.zeros((), jnp.int32), k, v, rows.lengths, rows.context, rows.live, rows.remaining, rows.sampled,
           zeros_R, out)
  carry = jax.lax.while_loop(lambda c: (c[0] < rounds) & jnp.any(c[5]), round_, start)
  _, k, v, *_, finish, out = carry
  return k, v, out._replace(finish=finish)


def _policy_logits(params: Params, k: tuple, v: tuple, rows: VerifyRows, tokens_RT: jax.Array, *, cfg: ModelConfig,
                   rules: sharding.Rules, kernel: Kernel | None,
                   record_routes: bool) -> tuple[jax.Array, paged_kv_cache.PagedKVCache, jax.Array | None]:
  """The policy's logits [R, T, V] after each of tokens_RT, written at positions lengths[r] + 0 .. drafts[r]
  (`_forward`'s results)."""
  cache = paged_kv_cache.PagedKVCache(k=k, v=v, page_table=rows.page_table, lengths=rows.lengths,
                                      new_tokens=rows.drafts + 1, pairs=rows.pairs, kernel=kernel)
  positions = rows.lengths[:, None] + jnp.arange(tokens_RT.shape[1], dtype=jnp.int32)[None]
  return _forward(params, tokens_RT, cfg, cache, positions, rules, record_routes)


def _forward(params: Params, tokens: jax.Array, cfg: ModelConfig, cache: paged_kv_cache.PagedKVCache,
             positions: jax.Array, rules: sharding.Rules,
             record_routes: bool) -> tuple[jax.Array, paged_kv_cache.PagedKVCache, jax.Array | None]:
  """`forward_with_cache`: (float32 logits [R, T, V], the cache), and the fed tokens' experts [R, T, L, k] with
  `record_routes` (else None)."""
  x, cache, trace = hidden_with_cache(params, tokens, cfg, cache, positions=positions, rules=rules)
  return unembed(params, x, cfg, rules), cache, trace.routes if record_routes else None


def _verified(logits_RTV: jax.Array, tokens_RT: jax.Array, accepted_R: jax.Array, sampling: SamplingConfig,
              tempered_log_probs: bool) -> Verified:
  """The emitted tokens with their log-probs under the policy's logits (raw, or at the sampling temperature)."""
  log_probs_RT = token_log_probs(tempered(logits_RTV, sampling.temperature if tempered_log_probs else 1.0), tokens_RT)
  return Verified(tokens=tokens_RT, log_probs=log_probs_RT, accepted=accepted_R)


def _jit(fn: Callable, **options) -> Callable:
  """`fn` jitted over a function object of its own: jax keys compiled programs by the function, so no other
  `Programs` set shares them, and clearing this one's cache frees only its executables."""
  own = functools.wraps(fn)(lambda *args, **kwargs: fn(*args, **kwargs))
  return jax.jit(own, **options)


class Programs:
  """One set of the engine's jitted programs; each compiles once per shape bucket and keeps what it compiled.

  Every engine runs `SHARED` unless given another: training's engines,
  one per step, reuse its compiled programs. A caller whose engines run
  rarely, and at shapes of their own (checkpoint evaluations), makes a set
  with `Programs()` and `release`s it after. An XLA:CPU executable of a
  30-layer model maps over a thousand memory regions (`map_budget`), and
  programs kept across a run's evaluations and its training crossed Linux's
  per-process limit, where LLVM aborts the process. So, too, a call that
  compiled releases the set when the process's maps are `crowded`: its
  programs compile again as they are next called (or load from the
  persistent compilation cache), where crossing the limit would end the run.

  Attributes:
    prefill, decode, verify, speculate, copy: the programs, called as the
      functions they jit.
    releases: how often the set has dropped its programs because the maps
      were crowded.
  """

  def __init__(self):
    """A new set whose compiled programs are its own (a second set compiles its shapes again)."""
    self._jitted = dict(
        prefill=_jit(prefill_pages, static_argnames=("cfg", "rules", "kernel", "record_routes"),
                     donate_argnums=(1, 2)),
        decode=_jit(decode_pages, static_argnames=("cfg", "sampling", "steps", "tempered_log_probs", "pad_id",
                                                   "rules", "kernel", "record_routes"), donate_argnums=(1, 2)),
        verify=_jit(verify_pages, static_argnames=("cfg", "sampling", "tempered_log_probs", "rules", "kernel",
                                                   "record_routes"), donate_argnums=(1, 2)),
        speculate=_jit(speculate_pages, static_argnames=("cfg", "drafter", "drafts", "rounds", "sampling",
                                                         "tempered_log_probs", "pad_id", "rules", "kernel",
                                                         "record_routes"), donate_argnums=(1, 2)),
        copy=_jit(paged_kv_cache.copy_pages, static_argnames=("rules",), donate_argnums=(0, 1)))
    self.releases = 0
    for name, jitted in self._jitted.items():
      setattr(self, name, functools.partial(self._call, jitted))

  @property
  def compiled(self) -> int:
    """Executables the set holds (one per program and shape bucket compiled so far)."""
    return sum(jitted._cache_size() for jitted in self._jitted.values())

  def release(self) -> None:
    """Drops every executable the set compiled (their memory maps with them); a later call compiles again."""
    for jitted in self._jitted.values():
      jitted.clear_cache()

  def _call(self, jitted: Callable, *args, **kwargs):
    """`jitted(*args, **kwargs)`; when the call compiled and the process's maps are crowded, the set is released."""
    held = jitted._cache_size()
    out = jitted(*args, **kwargs)
    if jitted._cache_size() > held and map_budget.crowded():
      compiled, maps = self.compiled, map_budget.held()
      self.release()
      self.releases += 1
      log.warning("engine programs: this process holds %d memory maps of the %s it may (vm.max_map_count); "
                  "dropped the set's %d compiled program(s), which compile again when next called (release %d)",
                  maps, map_budget.limit(), compiled, self.releases)
    return out


# Every engine's programs unless it is given its own.
SHARED = Programs()


def reading_pairs(page_lists: Sequence[Sequence[int]], blocks: int) -> paged_kv_cache.Pairs:
  """The (row, page, index) pairs of rows that read `page_lists[r]` (pages local to their block), as host arrays.

  Rows are split into `blocks` equal blocks (block-major, as the batch axes
  split them); each block's pairs hold its own row ids, and every block is
  padded to the same power-of-two count with sink pages past every length
  (the last row's, so rows stay sorted).
  """
  per_block = len(page_lists) // blocks
  chunks = []
  for block in range(blocks):
    lists = page_lists[block * per_block:(block + 1) * per_block]
    chunks.append((np.repeat(np.arange(per_block, dtype=np.int32), [len(p) for p in lists]),
                   np.asarray([page for p in lists for page in p], np.int32),
                   np.concatenate([np.arange(len(p), dtype=np.int32) for p in lists])))
  width = buckets.bucket(max(len(rows) for rows, _, _ in chunks), 8)
  past = np.int32((2 ** 31 - 1) // (1 << 12) - 1)  # a page index whose positions no row reaches (pages <= 4096 slots)
  out = [np.full((blocks, width), fill, np.int32) for fill in (per_block - 1, paged_kv_cache.SINK_PAGE, past)]
  for block, chunk in enumerate(chunks):
    for array, values in zip(out, chunk):
      array[block, :len(values)] = values
  return paged_kv_cache.Pairs(*(array.reshape(-1) for array in out))


@functools.lru_cache(maxsize=None)
def init_pool_program(cfg: ModelConfig, pages: int, page_size: int, placement, int8: bool = False):
  """The jitted allocation of an empty pool (`paged_kv_cache.init_pool`), one per shape, placement and storage.

  `placement` is one layer's (`paged_kv_cache.pool_sharding`), or None.
  """
  layers = None if placement is None else paged_kv_cache.pools_sharding(cfg, placement)
  out = None if placement is None else (layers, layers if cfg.cache_values else None)
  return jax.jit(functools.partial(paged_kv_cache.init_pool, cfg, pages, page_size, int8), out_shardings=out)
