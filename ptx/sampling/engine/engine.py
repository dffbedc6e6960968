"""The rollout engine: continuous batching over a paged KV cache, on the training mesh with its parameter arrays.

`generate` runs a fixed batch until its longest row stops, with a cache sized
for every row at the full budget. The engine instead keeps `max_seqs` rows
(slots) busy: a request takes a slot and the pages its own budget needs as
soon as both are free, and gives them back the moment it stops. Three
programs (`ptx.sampling.engine.programs`), each compiled once per shape
bucket, run on the pool of pages (`ptx.models.paged_kv_cache`), donated
through every call:

  prefill  writes up to `prefill_chunk` tokens of up to `prefill_rows` rows
           into their pages (a prompt, or the tool output a multi-turn episode
           appends with `extend`), chunk after chunk
  copy     copies pages (the last, partly filled prompt page of each sample
           of a group but the first, which keeps the original)
  decode   runs up to `decode_steps` tokens for every live row, each stopping
           at its own stop ids or budget

A sequence's cache holds every token but the last one sampled (or the last of
its prompt), which the next decode step feeds: so a prompt of p tokens is
prefilled up to p - 1, its first token is sampled by the first decode step,
and the G samples of a prompt share its full pages (reference counts,
`page_allocator`) with their own copy of the partly filled one.

Admission (`EngineConfig.admission`) comes in two kinds. "reserve" never
over-commits: a request is admitted only with the pages of its prompt plus
its whole `max_new_tokens` in hand, so a running sequence never waits for a
page and nothing is ever preempted. "on_demand" admits a request with the
pages of its prompt and its first call, and before every step gives each
sequence the pages its next call may fill: when a device's block runs out,
the sequences submitted last there are preempted (pages and slot freed, their
context queued to be prefilled again, as after an update; their log-probs
then differ from an uninterrupted run's by float rounding) until the older
ones fit, so a workload whose rows mostly stop early runs many more rows in
the same pool. Sequences submitted with `keep=True` (multi-turn episodes)
reserve in both kinds. Requests are admitted in submission order, preempted
ones first. Parameters are read where training placed them, never copied.
Token t of sequence i is drawn with the uniform of
fold_in(fold_in(key(seed), i), t), so the same seed and submission order give
the same tokens whatever the slots, pages, page size, preemptions or timing,
up to float rounding: the rows a call packs set the order of its float32 sums,
which over long rollouts can flip a near-tie (benchmarks/RESULTS.md).

An engine built with `record_routes` (a Mixture-of-Experts model, for routing
replay) has every program also return the experts each MoE layer chose for
the tokens it fed, and keeps them per sequence on the host beside its cached
tokens (`HostSequence.routes`, int16): a completion carries those of its whole
context but the last token (`Completion.routes`). The device hands back
R x decode_steps x L x k x 2 bytes more per decode call, and per prefill call
its rows x prefill_chunk x L x k x 2.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models import paged_kv_cache
from ptx.models.decoder import Params
from ptx.sampling import buckets
from ptx.sampling.engine import sequences
from ptx.sampling.engine.admission import Admission
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.programs import SHARED, DecodeRows, Programs, init_pool_program, reading_pairs
from ptx.sampling.engine.sequences import Completion, HostSequence, SeqState
from ptx.sampling.engine.pages import PageAllocator
from ptx.sampling.rules import SamplingConfig


class LiveRows(NamedTuple):
  """Live sequences packed into a call's rows (`RolloutEngine._live_rows`): the rows, and what each row holds."""

  row_of: dict[int, int]  # each sequence's row, by seq_id
  n_rows: int  # R
  page_table: np.ndarray  # int32 [R, pages_per_seq]: each sequence's pages, then (and in empty rows) the sink page
  lengths: np.ndarray  # int32 [R]: cached positions
  live: np.ndarray  # bool [R]: rows that hold a sequence
  remaining: np.ndarray  # int32 [R]: tokens the row may still sample
  stop_ids: np.ndarray  # int32 [R, S], padded with -1
  seq_ids: np.ndarray  # int32 [R]
  sampled: np.ndarray  # int32 [R]: tokens sampled so far (the RNG counter)
  pairs: paged_kv_cache.Pairs  # placed: the pages each row reads, up to the positions the call may fill


class RolloutEngine:
  """Continuous batching of sampling requests over a paged KV cache (see the module docstring).

  Typical use: `submit` requests, then call `step(params)` until `busy` is
  False (or `run(params)`), collecting the `Completion`s each step returns.
  Between steps, sequences submitted with `keep=True` can be `extend`ed with
  new tokens (a tool's output) and decoded on, or `release`d.
  """

  def __init__(self, cfg: ModelConfig, config: EngineConfig = EngineConfig(), *,
               sampling: SamplingConfig = SamplingConfig(), seed: int | jax.Array = 0, mesh: Mesh | None = None,
               tempered_log_probs: bool = False, pad_id: int = 0, rules: sharding.Rules = sharding.DEFAULT_RULES,
               programs: Programs = SHARED, record_routes: bool = False):
    """Allocates the pool of pages (on `mesh`, pages over its batch axes and KV heads over `tensor`).

    Args:
      cfg: the model config.
      config: the engine's shapes.
      sampling: the sampling rules of every request.
      seed: the RNG seed, or a PRNG key (see the module docstring).
      mesh: the training mesh; None runs on the default device.
      tempered_log_probs: completions carry the log-probs of the policy at
        `sampling.temperature` (GRPO's), else the raw policy's.
      pad_id: the token written after a row's last one in the programs' outputs.
      rules: the sharding rules.
      programs: the jitted programs it runs (`ptx.sampling.engine.programs`:
        the shared set, or a set its caller releases).
      record_routes: record the experts every MoE layer chose for every token
        (`Completion.routes`, for routing replay); needs a MoE model.

    Raises:
      ValueError: when the slots, prefill rows or pages do not split over
        the mesh's batch axes, or `cfg.attention_impl` asks for a Pallas
        kernel that cannot read these pages (`paged_kv_cache.kernel_for`), or
        `record_routes` for a model without experts.
    """
    if record_routes and not cfg.moe.enabled:
      raise ValueError("RolloutEngine: record_routes needs a Mixture-of-Experts model (model.moe.n_experts > 0)")
    self.cfg, self.config, self.sampling, self.mesh, self.rules = cfg, config, sampling, mesh, rules
    self.programs, self.record_routes = programs, record_routes
    int8 = config.kv_dtype == "int8"
    self._statics = dict(cfg=cfg, rules=rules, kernel=paged_kv_cache.kernel_for(cfg, config.page_size, int8),
                         record_routes=record_routes)
    self._decode_statics = dict(sampling=sampling, steps=config.decode_steps, tempered_log_probs=tempered_log_probs,
                                pad_id=pad_id)
    blocks = paged_kv_cache.page_blocks(config.pages, mesh, rules)
    for name in ("max_seqs", "prefill_rows"):
      if getattr(config, name) % blocks:
        raise ValueError(f"EngineConfig.{name} = {getattr(config, name)} must be a multiple of the {blocks} devices "
                         "that split the batch")
    self._admission = Admission(config, blocks)
    shardings = None if mesh is None else paged_kv_cache.pool_sharding(cfg, config.pages, config.page_size, mesh,
                                                                       rules, int8)
    with self._on_mesh():
      pool = init_pool_program(cfg, config.pages, config.page_size, shardings, int8)()
    self._k, self._v = pool
    self._key = seed if isinstance(seed, jax.Array) else jax.random.key(seed)
    self._sequences: dict[int, HostSequence] = {}
    self._next_id = 0
    self._version: int | None = None  # the policy_version of the last step: whose parameters the cache holds
    self._stalled = False

  @property
  def pool_bytes(self) -> int:
    """Bytes of the K/V pool on all devices: the engine's KV memory, whatever its fill."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((self._k, self._v)))

  @property
  def allocator(self) -> PageAllocator:
    """The pool's pages: which are free, in use, shared, and the peak in use."""
    return self._admission.allocator

  @property
  def preemptions(self) -> int:
    """Sequences preempted so far ("on_demand" admission)."""
    return self._admission.preemptions

  @property
  def busy(self) -> bool:
    """Whether any request is queued or decoding (held sequences do not count)."""
    return self._admission.waiting or bool(self._admission.admitted(SeqState.LIVE))

  def submit(self, prompt: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int] = (), samples: int = 1,
             keep: bool = False, reserve: int = 0) -> list[int]:
    """Queues `samples` sequences that continue `prompt`; returns their ids (consecutive, in sample order).

    Args:
      prompt: the token ids, at least one.
      max_new_tokens: tokens each sample may generate.
      stop_ids: ids that end a sample (counted in its tokens).
      samples: samples G of the prompt; they share its prompt pages.
      keep: hold each sample's slot and pages after it finishes, for `extend`
        or `release`; else they are freed at once.
      reserve: cached positions each sample's pages cover from admission on,
        when more than its prompt and `max_new_tokens` (a multi-turn episode
        reserves its whole context, so its `extend`s never wait for pages
        that other episodes hold).

    Raises:
      ValueError: naming the request, for an empty prompt, a token outside the
        vocabulary, a budget below 1, or a request the engine could never hold.
    """
    request = f"request {self._next_id} (prompt of {len(prompt)} tokens)"
    prompt = [int(t) for t in prompt]
    if not prompt:
      raise ValueError(f"{request}: the prompt is empty")
    bad = [i for i, t in enumerate(prompt) if not 0 <= t < self.cfg.vocab_size]
    if bad:
      raise ValueError(f"{request}: token {prompt[bad[0]]} at position {bad[0]} is outside the vocabulary "
                       f"[0, {self.cfg.vocab_size})")
    if max_new_tokens < 1 or samples < 1:
      raise ValueError(f"{request}: max_new_tokens ({max_new_tokens}) and samples ({samples}) must be >= 1")
    reserve = max(reserve, len(prompt) - 1 + max_new_tokens)
    self._check_room(request, reserve)
    if samples > self._admission.slots_per_block:
      raise ValueError(f"{request}: {samples} samples share pages on one device, which has "
                       f"{self._admission.slots_per_block} slots")
    need = self._admission.group_pages(len(prompt) - 1, reserve, samples)
    if need > self.allocator.capacity:
      raise ValueError(f"{request}: {samples} samples of {max_new_tokens} new tokens need {need} pages, more than "
                       f"the {self.allocator.capacity} of one device's block (EngineConfig.pages)")
    group = [HostSequence(seq_id=self._next_id + g, max_new=max_new_tokens, stop_ids=tuple(int(s) for s in stop_ids),
                       keep=keep, feed=prompt[:-1], pending=prompt[-1], reserve=reserve) for g in range(samples)]
    for follower in group[1:]:
      follower.leader = group[0]
    group[0].followers = group[1:]
    self._next_id += samples
    self._sequences.update((s.seq_id, s) for s in group)
    self._admission.queue.append(group)
    return [s.seq_id for s in group]

  def extend(self, seq_id: int, tokens: Sequence[int], *, max_new_tokens: int,
             stop_ids: Sequence[int] | None = None) -> None:
    """Appends `tokens` to a held sequence and queues it to decode `max_new_tokens` more (its stop ids, unless given).

    Raises:
      ValueError: for a sequence that is not held, empty tokens, or more
        positions than `max_seq_len`.
    """
    seq = self._held(seq_id, "extend")
    tokens = [int(t) for t in tokens]
    if not tokens or max_new_tokens < 1:
      raise ValueError(f"sequence {seq_id}: extend needs tokens and max_new_tokens >= 1")
    self._check_room(f"sequence {seq_id}", seq.length + len(seq.feed) + len(tokens) + max_new_tokens)
    # The cache lacks the token sampled last: it is fed with the new ones, and their last one becomes pending.
    seq.feed, seq.pending, seq.max_new = seq.feed + [seq.pending] + tokens[:-1], tokens[-1], max_new_tokens
    seq.stop_ids = seq.stop_ids if stop_ids is None else tuple(int(s) for s in stop_ids)
    seq.state = SeqState.EXTEND
    self._admission.extends.append(seq)

  def release(self, seq_id: int) -> None:
    """Frees a held or live sequence's slot and pages (a live one is dropped mid-turn)."""
    seq = self._sequences.get(seq_id)
    if seq is None or seq.state not in (SeqState.HELD, SeqState.LIVE):
      raise ValueError(f"sequence {seq_id} is not held or live: {None if seq is None else seq.state.value}")
    self._free(seq)

  def step(self, params: Params, *, policy_version: int = 0) -> list[Completion]:
    """Admits what the free slots and pages hold, prefills it, then runs one decode call.

    A `policy_version` other than the last call's means new parameters: the
    cache of every admitted sequence is recomputed under them first (its
    whole context prefilled again, a group's shared prompt pages once per
    sample), so each token is sampled from the policy `params` define, given
    its context, and the version stamped on it says which.

    Args:
      params: the parameter tree, placed as training placed it.
      policy_version: which parameters `params` are; stamped on every token
        this call samples.

    Returns:
      The turns that finished in this call.

    When nothing is decoding after admission (queued work waits for slots or
    pages that held sequences keep), the call does nothing and `stalled`
    says so until a call decodes again.
    """
    if self._version is not None and policy_version != self._version:
      self._refresh()
    self._version = policy_version
    call_tokens = self._call_tokens()
    self._admission.make_room(call_tokens)
    self._admission.admit(call_tokens)
    with self._on_mesh():
      self._prefill(params)
      self._start_followers()
      self._stalled = not self._admission.admitted(SeqState.LIVE)
      if self._stalled:
        return []
      return self._decode(params, policy_version)

  @property
  def stalled(self) -> bool:
    """Whether the last `step` could decode nothing while work was queued (held sequences keep what it needs)."""
    return self._stalled and self.busy

  def run(self, params: Params, *, policy_version: int = 0) -> dict[int, Completion]:
    """Steps until nothing is queued or decoding; returns every finished turn by sequence id.

    Raises:
      RuntimeError: when queued work can never be admitted because every
        slot or page is taken by held sequences (release some).
    """
    done = {}
    while self.busy:
      done.update((c.seq_id, c) for c in self.step(params, policy_version=policy_version))
      if self.stalled:
        raise RuntimeError(
            f"sequence {self._admission.first_waiting().seq_id} cannot be admitted: {self.allocator.in_use} pages "
            f"and {sum(s is not None for s in self._admission.slots)} slots are held by finished sequences (release "
            "them)")
    return done

  def snapshot(self) -> dict[str, np.ndarray]:
    """Every unfinished sequence as host arrays, for a checkpoint: `restore` on a fresh engine goes on from here.

    A sequence is saved as its context (the tokens its cache holds or is to
    hold), its pending token, what it sampled in this turn and its RNG
    counter, not its pages: a restored engine prefills the context again
    under the `step` parameters, which is what this engine does after an
    update, so the same parameters give the same tokens as the uninterrupted
    engine (see `step`).

    Raises:
      ValueError: when a sequence is held for `extend` (multi-turn episodes
        are not saved yet).
    """
    held = [s.seq_id for s in self._sequences.values() if s.state in (SeqState.HELD, SeqState.EXTEND)]
    if held:
      raise ValueError(f"cannot snapshot the engine: sequences {held} are held for extend (release them first)")
    admitted = sorted((s for s in self._sequences.values() if s.state is not SeqState.QUEUED), key=lambda s: s.seq_id)
    groups = ([[s] for s in admitted] + [[s] for s in self._admission.preempted]
              + [list(g) for g in self._admission.queue])
    return sequences.to_arrays(groups, self._next_id, self._version)

  def restore(self, saved: dict[str, np.ndarray]) -> None:
    """Queues the sequences of a `snapshot` on this engine, which must hold none yet."""
    if self._sequences:
      raise ValueError(f"restore needs an empty engine; this one holds {len(self._sequences)} sequences")
    groups, self._next_id, self._version = sequences.from_arrays(saved)
    for group in groups:
      self._sequences.update((s.seq_id, s) for s in group)
      self._admission.queue.append(group)

  # Host side.

  def _on_mesh(self):
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def _check_room(self, what: str, positions: int) -> None:
    if positions > self.config.max_seq_len:
      raise ValueError(f"{what}: needs {positions} cached positions; EngineConfig.max_seq_len is "
                       f"{self.config.max_seq_len}")

  def _held(self, seq_id: int, action: str) -> HostSequence:
    seq = self._sequences.get(seq_id)
    if seq is None or seq.state is not SeqState.HELD:
      raise ValueError(f"cannot {action} sequence {seq_id}: it is not held "
                       f"({'unknown' if seq is None else seq.state.value}; submit with keep=True)")
    return seq

  def _call_tokens(self) -> int:
    """Positions a call may write past a sequence's cached ones, at most: the pages "on_demand" gives it first."""
    return self.config.decode_steps

  def _refresh(self) -> None:
    """Marks every admitted sequence's cached tokens to be prefilled again (under the next call's parameters)."""
    for seq in self._sequences.values():
      if seq.cached:
        seq.uncache()
        if seq.state is SeqState.LIVE:
          seq.state = SeqState.PREFILL

  def _prefill(self, params: Params) -> None:
    """Writes every admitted sequence's feed: up to `prefill_rows` rows and `prefill_chunk` tokens per call."""
    C, most = self.config.prefill_chunk, self.config.prefill_rows // self.allocator.blocks
    recorded: list[tuple[jax.Array, list[tuple[HostSequence, int, int]]]] = []  # (routes, [(seq, row, tokens)])
    while True:
      waiting = self._admission.admitted(SeqState.PREFILL)
      taken, per_block = [], [0] * self.allocator.blocks
      for seq in waiting:
        if not seq.feed:
          seq.state = SeqState.LIVE
        elif per_block[seq.block] < most:
          taken.append(seq)
          per_block[seq.block] += 1
      if not taken:
        break
      row_of, A = self._pack_rows(taken, most)
      tokens = np.zeros((A, C), np.int32)
      lengths, new = np.zeros((A,), np.int32), np.zeros((A,), np.int32)
      table = np.full((A, self.config.pages_per_seq), paged_kv_cache.SINK_PAGE, np.int32)
      reads: list[list[int]] = [[] for _ in range(A)]
      for seq in taken:
        row, chunk = row_of[seq.seq_id], seq.feed[:C]
        tokens[row, :len(chunk)], lengths[row], new[row] = chunk, seq.length, len(chunk)
        table[row, :len(seq.pages)] = seq.pages
        seq.feed, seq.length = seq.feed[C:], seq.length + len(chunk)
        seq.cached += chunk
        reads[row] = seq.pages[:self._admission.pages_for(seq.length)]
      pairs = reading_pairs(reads, self.allocator.blocks)
      out = self.programs.prefill(params, self._k, self._v, *self._rows(table, lengths, new),
                                  paged_kv_cache.Pairs(*self._rows(*pairs)), *self._rows(tokens), **self._statics)
      self._k, self._v = out[:2]
      if self.record_routes:
        recorded.append((out[2], [(seq, row_of[seq.seq_id], int(new[row_of[seq.seq_id]])) for seq in taken]))
    # Fetched once, after every chunk is dispatched: the decode call that follows waits for the chunks anyway.
    for routes, rows in zip(jax.device_get([routes for routes, _ in recorded]), (rows for _, rows in recorded)):
      for seq, row, n in rows:
        seq.routes.append(routes[row, :n].copy())  # a view would keep the call's whole array

  def _start_followers(self) -> None:
    """Gives every group whose leader is prefilled its prompt: shared full pages, a copy of the partial one."""
    pairs: list[list[tuple[int, int]]] = [[] for _ in range(self.allocator.blocks)]
    for leader in [s for s in self._admission.admitted(SeqState.LIVE) if s.followers]:
      shared = leader.length // self.config.page_size
      for seq in leader.followers:
        if leader.length % self.config.page_size:
          pairs[seq.block].append((leader.pages[shared], seq.pages[shared]))
        seq.length, seq.state, seq.cached = leader.length, SeqState.LIVE, list(leader.cached)
        seq.routes = list(leader.routes)
      leader.followers = []
    if not any(pairs):
      return
    width = buckets.bucket(max(map(len, pairs)))
    table = np.zeros((self.allocator.blocks, width, 2), np.int32)  # sink-to-sink pairs pad each block
    for block, block_pairs in enumerate(pairs):
      if block_pairs:
        table[block, :len(block_pairs)] = block_pairs
    sources, targets = self._rows(table[..., 0].reshape(-1), table[..., 1].reshape(-1))
    self._k, self._v = self.programs.copy(self._k, self._v, sources, targets, rules=self.rules)

  def _decode(self, params: Params, policy_version: int) -> list[Completion]:
    """One decode call over the live sequences; returns the turns that finished and frees what they held."""
    steps = self.config.decode_steps
    live = self._admission.admitted(SeqState.LIVE)
    packed = self._live_rows(live, lambda seq: seq.length + min(steps, seq.remaining))
    pending = np.zeros((packed.n_rows,), np.int32)
    for seq in live:
      pending[packed.row_of[seq.seq_id]] = seq.pending
    rows = DecodeRows(*self._rows(packed.page_table, packed.lengths, pending, packed.live, packed.remaining,
                                  packed.stop_ids, packed.seq_ids, packed.sampled), packed.pairs)
    self._k, self._v, out = self.programs.decode(params, self._k, self._v, rows, self._key, **self._statics,
                                                 **self._decode_statics)
    tokens, log_probs, emitted, finish, routes = jax.device_get(tuple(out))
    done = [self._emit(seq, tokens[r, :emitted[r]].tolist(), log_probs[r, :emitted[r]].tolist(), int(finish[r]),
                       policy_version, None if routes is None else routes[r, :emitted[r]].copy())
            for seq, r in ((seq, packed.row_of[seq.seq_id]) for seq in live)]
    return [c for c in done if c is not None]

  def _emit(self, seq: HostSequence, tokens: list[int], log_probs: list[float], finish: int, policy_version: int,
            routes: np.ndarray | None) -> Completion | None:
    """Appends a call's tokens (one or more) to `seq`, and the routes [n, L, k] of the n tokens the call fed (when
    recording); returns its turn when `finish` ends it, freeing what it held."""
    n = len(tokens)
    if routes is not None:
      seq.routes.append(routes)
    seq.tokens += tokens
    seq.log_probs += log_probs
    seq.versions += [policy_version] * n
    seq.cached += [seq.pending] + tokens[:n - 1]
    seq.length, seq.sampled, seq.pending = seq.length + n, seq.sampled + n, tokens[-1]
    if not finish:
      return None
    done = Completion(seq_id=seq.seq_id, tokens=np.asarray(seq.tokens, np.int32),
                      log_probs=np.asarray(seq.log_probs, np.float32),
                      policy_versions=np.asarray(seq.versions, np.int32), finish_reason=finish,
                      routes=seq.cached_routes() if self.record_routes else None)
    seq.tokens, seq.log_probs, seq.versions = [], [], []
    if seq.keep:
      seq.state = SeqState.HELD
    else:
      self._free(seq)
    return done

  def _pack_rows(self, seqs: list[HostSequence], most: int) -> tuple[dict[int, int], int]:
    """Rows for `seqs` in one call: each block's sequences packed into its own power-of-two run of rows.

    A call computes every row it is given, so rows are packed from the
    sequences that take part (at most `most` per block) rather than taken
    from all the slots; each block's rows stay in its own run, as its pages
    do. Returns ({seq_id: row}, the number of rows).
    """
    by_block: list[list[HostSequence]] = [[] for _ in range(self.allocator.blocks)]
    for seq in seqs:
      by_block[seq.block].append(seq)
    per_block = min(buckets.bucket(max(len(b) for b in by_block)), most)
    rows = {seq.seq_id: block * per_block + i for block, block_seqs in enumerate(by_block)
            for i, seq in enumerate(block_seqs)}
    return rows, per_block * self.allocator.blocks

  def _live_rows(self, live: list[HostSequence], positions: Callable[[HostSequence], int]) -> LiveRows:
    """`live` packed into rows (`_pack_rows`), each reading its pages up to the `positions(seq)` the call may fill."""
    row_of, R = self._pack_rows(live, self._admission.slots_per_block)
    table = np.full((R, self.config.pages_per_seq), paged_kv_cache.SINK_PAGE, np.int32)
    lengths, remaining, seq_ids, sampled = (np.zeros((R,), np.int32) for _ in range(4))
    is_live = np.zeros((R,), bool)
    stops = np.full((R, buckets.bucket(max([len(s.stop_ids) for s in live] + [1]))), -1, np.int32)
    reads: list[list[int]] = [[] for _ in range(R)]
    for seq in live:
      r = row_of[seq.seq_id]
      table[r, :len(seq.pages)] = seq.pages
      needed = self._admission.pages_for(positions(seq))
      reads[r] = seq.pages[:needed]
      if len(reads[r]) < needed:  # its writes would go to the sink: never silently
        raise RuntimeError(f"sequence {seq.seq_id} holds {len(seq.pages)} pages; its call may fill "
                           f"{positions(seq)} positions")
      lengths[r], remaining[r], seq_ids[r], sampled[r], is_live[r] = (seq.length, seq.remaining, seq.seq_id,
                                                                      seq.sampled, True)
      stops[r, :len(seq.stop_ids)] = seq.stop_ids
    pairs = paged_kv_cache.Pairs(*self._rows(*reading_pairs(reads, self.allocator.blocks)))
    return LiveRows(row_of, R, table, lengths, is_live, remaining, stops, seq_ids, sampled, pairs)

  def _free(self, seq: HostSequence) -> None:
    self._admission.free(seq)
    del self._sequences[seq.seq_id]

  def _rows(self, *arrays: np.ndarray) -> tuple[jax.Array, ...]:
    """Host arrays placed with their first axis over the batch axes (blocks of rows, pairs)."""
    if self.mesh is None:
      return tuple(jnp.asarray(x) for x in arrays)
    return tuple(jax.device_put(x, NamedSharding(self.mesh, sharding.logical_to_spec(
        ("batch",) + (None,) * (x.ndim - 1), self.rules, shape=x.shape, mesh=self.mesh))) for x in arrays)
