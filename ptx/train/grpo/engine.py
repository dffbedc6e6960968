"""GRPO's host-reward mode over the rollout engine: groups scored as they finish, partial rollouts across updates.

`grpo.rollouts = "engine"` draws the host-reward mode's rollouts from
`ptx.sampling.engine.engine.RolloutEngine` (continuous batching over a paged KV
cache, on the training mesh with the training arrays) instead of sampling
each batch with `generate`. Step k trains on prompt batch k, as the static
mode does, and keeps batches k + 1 .. k + s (`grpo.max_staleness` s) in the
engine too, so its slots are never idle behind batch k's longest rollout:
the engine decodes until every group of batch k has finished, each group
being scored on a host thread the moment its last sample finishes while the
engine decodes on, then the update runs and the next step decodes with the
new parameters.

Updates land between decode calls: a rollout of batch k + i may be sampled
under several policy versions (partial rollouts). Every token records the
version it was sampled under (`Completion.policy_versions`), the engine
recomputes its cache under each new version (`RolloutEngine.step`), and
batch j is submitted only at step j - s, so no token trained at step k is
older than s updates. With s > 0 the update recomputes PPO's old log-probs
at the current parameters and weights the loss by the truncated importance
ratio exp(old - sampler) per token (decoupled PPO, `learn(proximal=True)`),
as the static mode does; s = 0 is on-policy (every token of batch k sampled
at version k).

Fast mode (`rollout.mode="fast"`, `ptx.sampling.engine.mode`): the engine
is speculative (n-gram drafts) and samples from an int8 weight-only tree
derived from the training parameters once per update, on the mesh where
they live; the update trains the float parameters. The rollouts' log-probs
are the int8 model's, so every step recomputes the policy's old log-probs
and weights the loss by the truncated importance ratio, as s > 0 does, and
logs their gap (`ptx.train.grpo.metrics.logprob_gap`:
`rollout/logp_gap_abs`, `rollout/is_ratio/*`, `rollout/logp_mismatch_kl`).

Checkpoints hold the pipeline (`pipeline_state`): the engine's unfinished
sequences (`RolloutEngine.snapshot`), and the completions and rewards of
the batches in flight; a resumed run restores them and trains on the same
tokens as the uninterrupted one. DAPO's refill (`filter_groups="refill"`) is
the static mode's only.

Routing replay (`grpo.routing_replay="rollout"`, R3): the engine records the
experts every MoE layer chose for each token it fed (`RolloutEngine`'s
`record_routes`), and the rows carry them as `routes` [R, P + N, L, k]
(`moe.NO_ROUTE` on padding and on each row's last token, never fed), which
the update's forwards replay: R x (P + N) x L x k x 2 bytes host to device a
step. A token's routes are those of the forward that last wrote its K/V: after
an update the engine prefills its sequences again and records them anew, so a
partial rollout replays the routes the policy that finished it read. In fast
mode they are the int8 sampler's (its verify and decode forwards'). The
pipeline's finished completions keep theirs in a checkpoint; unfinished
sequences record theirs again when the restored engine prefills them.

Metrics add `timing_s/step`, `timing_s/generate` (decoding until batch k
finished), `timing_s/reward` (waiting for its last scores after that),
`rollout/staleness` (the oldest token's age in updates),
`rollout/staleness_mean` (per token), `rollout/engine_pages_peak` and
`rollout/engine_preemptions` (sequences preempted in the step); with
speculation, `rollout/drafted` (drafts per response token) and
`rollout/draft_acceptance` (the fraction of drafts the policy accepted).

Transcripts (`ptx.train.grpo.samples`): a step that `grpo.samples_every`
selects keeps the first rows of the batch it trains on, decoded by the
Job's tokenizer.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from ptx import config_rules
from ptx.data.global_batch import to_global
from ptx.data.lookahead import Lookahead
from ptx.data.tokenizer import Tokenizer
from ptx.episodes.scoring import HostReward
from ptx.model_config import ModelConfig
from ptx.models import moe
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.mode import RolloutMode
from ptx.sampling.engine.sequences import Completion
from ptx.sampling.generation import Generation
from ptx.train.grpo.samples import SampleLog, rows_of
from ptx.train.grpo.update import GRPOStepKind, RLSpec, jit_learn, rollout_batch
from ptx.train.state import TrainState
from ptx.train.step import model_params

# fold_in data of the engine's key from the state's rng: RL steps fold in their step, which never gets this large.
_ENGINE_STREAM = 2 ** 31 - 1


@dataclasses.dataclass(frozen=True)
class EngineGRPOStep(GRPOStepKind):
  """The host-reward GRPO step of a Job with engine rollouts: `spec`, host `reward`, the engine's shapes and mode,
  and the transcripts' tokenizer."""

  reward: HostReward
  engine: EngineConfig = EngineConfig()
  mode: RolloutMode = RolloutMode()
  tokenizer: Tokenizer | None = dataclasses.field(default=None, compare=False)

  def stream(self, data: Any) -> Lookahead:
    """The prompt iterator as `fit` reads it: a `Lookahead`, which the step peeks to submit batches ahead."""
    return Lookahead.of(data)

  def build(self, optimizer: optax.GradientTransformation, mesh: Mesh, state_shardings: TrainState,
            data: Lookahead) -> "EngineRewardStep":
    """The step object for `fit`, submitting batches ahead of `data` (`stream`'s) to the engine."""
    return EngineRewardStep(spec=self.spec, optimizer=optimizer, mesh=mesh, state_shardings=state_shardings,
                            reward=self.reward, prompts=data, engine=self.engine, mode=self.mode,
                            tokenizer=self.tokenizer)


@dataclasses.dataclass(eq=False)
class _Batch:
  """A prompt batch in the engine: the one step `index` trains on."""

  index: int
  prompts: np.ndarray  # int32 [B, P], left-padded
  lengths: np.ndarray  # int32 [B]
  task: Any  # the B task records
  seq_ids: list[list[int]]  # [B][G]: the engine's sequence ids of each group
  done: dict[int, Completion] = dataclasses.field(default_factory=dict)
  scores: dict[int, Any] = dataclasses.field(default_factory=dict)  # group -> its [G] rewards (or a future of them)

  def complete(self) -> bool:
    return len(self.done) == sum(map(len, self.seq_ids))


class EngineRewardStep:
  """`step(state, batch) -> (state, metrics)` of the host-reward mode with engine rollouts, for `fit`.

  Args:
    spec: the static step description (shared with the fused step).
    optimizer: the optax transformation of the state.
    mesh: the device mesh.
    state_shardings: the state's shardings.
    reward: scores completions on the host: called with one or more whole
      groups (their tokens [n * G, N], lengths and n tasks), on one thread.
    prompts: the prompt stream `fit` also reads (its `next` gives the
      step's batch; the step peeks the next `max_staleness`).
    engine: the engine's shapes for one device; `max_seq_len` must hold a
      prompt batch's width plus `max_new_tokens`. Its slots, prefill rows and
      pages are rounded up to the devices that split the batch, each device's
      block of pages gaining its own sink page.
    mode: the engine and the tree it samples from (standard, or fast: int8
      and speculative; module docstring).
    tokenizer: decodes the transcripts' rows (None: no transcripts).

  Raises:
    ConfigError: for `filter_groups="refill"`.
    ValueError: for an int8 mode under LoRA.
  """

  def __init__(self, *, spec: RLSpec, optimizer: optax.GradientTransformation, mesh: Mesh,
               state_shardings: TrainState, reward: HostReward, prompts: Lookahead, engine: EngineConfig,
               mode: RolloutMode = RolloutMode(), tokenizer: Tokenizer | None = None):
    config_rules.check_engine_rollouts(spec.grpo)
    if spec.lora is not None and mode.int8:
      raise ValueError("int8 rollouts quantise plain parameters; under LoRA set rollout.mode=standard")
    self.staleness = spec.grpo.max_staleness
    # Stale or int8-sampled rollouts: the policy's log-probs are recomputed and the loss importance-weighted.
    proximal = self.staleness > 0 or not mode.exact
    engine = engine.on_mesh(mesh, spec.rules)
    self._spec, self._mesh, self._reward, self._prompts, self._engine_config = spec, mesh, reward, prompts, engine
    self._mode, self._rollout_params = mode, mode.params_fn(spec.model, mesh, spec.rules)
    self._learn = jit_learn(spec, optimizer, mesh, state_shardings, proximal=proximal)
    self._engine: RolloutEngine | None = None
    self._batches: list[_Batch] = []  # in stream order: batch i trains at step batches[i].index
    self._owner: dict[int, tuple[_Batch, int]] = {}  # seq_id -> (its batch, its group)
    self._scorer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-reward")
    self._resumed: dict[str, Any] | None = None
    self._last_return: float | None = None
    self._samples = SampleLog(spec.grpo, tokenizer)
    self._records_routes = spec.grpo.routing_replay == "rollout"

  @property
  def learner(self) -> Any:
    """The jitted update program: (state, rollouts, gen, rewards) -> (state, metrics), state donated."""
    return self._learn

  def __call__(self, state: TrainState, batch: dict[str, Any]) -> tuple[TrainState, dict[str, Any]]:
    start = time.perf_counter()
    k = int(state.step)
    if self._engine is None:
      self._start(state, k)
    self._submit(k, batch)
    current = self._batches[0]
    params = self._rollout_params(model_params(state, self._spec.lora))  # once per update
    peak, preempted = 0, self._engine.preemptions
    while not current.complete():
      if not self._engine.busy:
        raise RuntimeError(f"the engine stopped with batch {current.index} unfinished")
      self._record(self._engine.step(params, policy_version=k))
      peak = max(peak, self._engine.allocator.in_use)
    decoded = time.perf_counter()
    rewards = self._rewards(current)
    scored = time.perf_counter()
    self._batches.pop(0)
    rollouts, gen, versions = self._assemble(current)
    if self._samples.due(k + 1):
      self._samples.keep(k + 1, rows_of(rollouts, gen, rewards, self._samples.rows), self._spec.grpo.group_size)
    state, metrics = self._learn(state, rollouts, gen, jax.tree.map(jnp.asarray, rewards))
    age = (k - versions)[versions >= 0]
    end = time.perf_counter()
    wall = end - (start if self._last_return is None else self._last_return)
    self._last_return = end
    take = getattr(self._reward, "take_metrics", None)
    metrics = {**metrics, **(take() if take is not None else {}), "timing_s/step": wall,
               "timing_s/generate": decoded - start, "timing_s/reward": scored - decoded,
               "rollout/staleness": float(age.max(initial=0)), "rollout/staleness_mean": float(age.mean()),
               "rollout/engine_pages_peak": float(peak),
               "rollout/engine_preemptions": float(self._engine.preemptions - preempted),
               **self._draft_metrics(current)}
    return state, metrics

  def _draft_metrics(self, b: _Batch) -> dict[str, float]:
    """Drafts per response token and the fraction accepted, over the batch's completions (speculative modes)."""
    if self._mode.speculative is None:
      return {}
    drafted, accepted = (sum(getattr(c, name) for c in b.done.values()) for name in ("drafted", "accepted"))
    tokens = sum(len(c.tokens) for c in b.done.values())
    return {"rollout/drafted": drafted / max(tokens, 1), "rollout/draft_acceptance": accepted / max(drafted, 1)}

  def take_samples(self, wait: bool = False) -> dict[int, bytes]:
    """The transcripts of the steps that kept rows (`ptx.train.grpo.samples.SampleLog.take`), by step."""
    return self._samples.take(wait)

  def pipeline_state(self) -> dict[str, Any] | None:
    """The engine's unfinished sequences and the batches in flight, as host arrays (None when there are none)."""
    if not self._batches:
      return None
    saved = {"engine": self._engine.snapshot(), "batches": {}}
    for i, b in enumerate(self._batches):
      done = sorted(b.done)
      groups = sorted(b.scores)
      scores = [self._score_of(b, g) for g in groups]
      saved["batches"][str(i)] = {
          "index": np.asarray(b.index, np.int64), "prompts": b.prompts, "lengths": b.lengths,
          "seq_ids": np.asarray(b.seq_ids, np.int32), "done": np.asarray(done, np.int32),
          "done_lengths": np.asarray([len(b.done[s].tokens) for s in done], np.int32),
          "tokens": _flat([b.done[s].tokens for s in done], np.int32),
          "log_probs": _flat([b.done[s].log_probs for s in done], np.float32),
          "versions": _flat([b.done[s].policy_versions for s in done], np.int32),
          "finish": np.asarray([b.done[s].finish_reason for s in done], np.int32),
          **(_flat_routes([b.done[s].routes for s in done], self._spec.model) if self._records_routes else {}),
          "scored_groups": np.asarray(groups, np.int32),
          "scores": jax.tree.map(lambda *x: np.stack(x), *scores) if scores else np.zeros((0,), np.float32)}
    # Orbax refuses zero-size arrays (no finished group yet, no token sampled): every array gains one row.
    return jax.tree.map(lambda x: x if x.ndim == 0 else np.concatenate([x, np.zeros_like(x[:1], shape=(1,) +
                                                                                     x.shape[1:])]), saved)

  def set_pipeline_state(self, saved: dict[str, Any]) -> None:
    """Takes back a checkpoint's pipeline; the next step restores it (the engine is built then)."""
    self._resumed = jax.tree.map(lambda x: np.asarray(x) if np.ndim(x) == 0 else np.asarray(x)[:-1], saved)

  # Host side.

  def _start(self, state: TrainState, k: int) -> None:
    """Builds the engine (its key from the state's rng, so a resumed run draws the same), restoring a pipeline."""
    spec = self._spec
    self._engine = self._mode.engine(spec.model, self._engine_config, sampling=spec.grpo.sampling,
                                     seed=jax.random.fold_in(state.rng, _ENGINE_STREAM), mesh=self._mesh,
                                     tempered_log_probs=True, pad_id=spec.pad_id, rules=spec.rules,
                                     record_routes=self._records_routes)
    saved, self._resumed = self._resumed, None
    if saved is None:
      return
    self._engine.restore(saved["engine"])
    for i in range(len(saved["batches"])):
      s = saved["batches"][str(i)]
      # The task records come back from the stream in `_submit` (the batch `fit` passes, then the peeked ones).
      b = _Batch(index=int(s["index"]), prompts=np.asarray(s["prompts"]), lengths=np.asarray(s["lengths"]),
                 task=None, seq_ids=np.asarray(s["seq_ids"]).tolist())
      ends = np.cumsum(s["done_lengths"])[:-1]
      routes = (np.split(np.asarray(s["routes"]), np.cumsum(s["routes_lengths"])[:-1]) if "routes" in s
                else [None] * len(s["finish"]))
      for seq_id, tokens, log_probs, versions, finish, seq_routes in zip(
          np.asarray(s["done"]).tolist(), np.split(np.asarray(s["tokens"]), ends),
          np.split(np.asarray(s["log_probs"]), ends), np.split(np.asarray(s["versions"]), ends), s["finish"], routes):
        b.done[seq_id] = Completion(seq_id=seq_id, tokens=tokens, log_probs=log_probs, policy_versions=versions,
                                    finish_reason=int(finish), routes=seq_routes)
      for j, group in enumerate(np.asarray(s["scored_groups"]).tolist()):
        b.scores[group] = jax.tree.map(lambda x: np.asarray(x)[j], s["scores"])
      self._batches.append(b)
      for g, ids in enumerate(b.seq_ids):
        self._owner.update((seq_id, (b, g)) for seq_id in ids if seq_id not in b.done)

  def _submit(self, k: int, batch: dict[str, Any]) -> None:
    """Puts batches k .. k + s in the engine (batch k is `batch`; the others are the stream's next ones)."""
    for i in range(self.staleness + 1):
      data = batch if i == 0 else self._prompts.peek(i - 1)
      if i < len(self._batches):
        self._batches[i].task = data["task"]  # a resumed batch gets its records back
        continue
      prompts, lengths = (np.asarray(jax.device_get(data[name])) for name in ("prompts", "prompt_lengths"))
      width, G = prompts.shape[1], self._spec.grpo.group_size
      seq_ids = [self._engine.submit(row[width - n:], max_new_tokens=self._spec.max_new_tokens,
                                     stop_ids=self._spec.stop_ids, samples=G) for row, n in zip(prompts, lengths)]
      b = _Batch(index=k + i, prompts=prompts, lengths=lengths, task=data["task"], seq_ids=seq_ids)
      self._batches.append(b)
      for g, ids in enumerate(seq_ids):
        self._owner.update((seq_id, (b, g)) for seq_id in ids)

  def _record(self, completions: list[Completion]) -> None:
    """Files finished sequences under their batch; queues the groups they complete for scoring, in one call."""
    finished: list[tuple[_Batch, int]] = []
    for c in completions:
      b, g = self._owner.pop(c.seq_id)
      b.done[c.seq_id] = c
      if all(s in b.done for s in b.seq_ids[g]):
        finished.append((b, g))
    if finished:
      future = self._scorer.submit(self._score, finished)
      for i, (b, g) in enumerate(finished):
        b.scores[g] = (future, i)

  def _score(self, groups: list[tuple[_Batch, int]]) -> list[Any]:
    """The rewards [G] (or named components) of whole groups, from one reward call."""
    G, N = self._spec.grpo.group_size, self._spec.max_new_tokens
    tokens = np.full((len(groups) * G, N), self._spec.pad_id, np.int32)
    lengths = np.zeros((len(groups) * G,), np.int32)
    for i, (b, g) in enumerate(groups):
      for j, seq_id in enumerate(b.seq_ids[g]):
        c = b.done[seq_id]
        tokens[i * G + j, :len(c.tokens)], lengths[i * G + j] = c.tokens, len(c.tokens)
    rewards = jax.tree.map(lambda r: np.asarray(r, np.float32), self._reward(tokens, lengths,
                                                                            [b.task[g] for b, g in groups]))
    return [jax.tree.map(lambda r: r[i * G:(i + 1) * G], rewards) for i in range(len(groups))]

  @staticmethod
  def _score_of(b: _Batch, group: int) -> Any:
    """A group's rewards, waiting for its scoring if it is still running."""
    value = b.scores[group]
    if isinstance(value, tuple):
      future, i = value
      value = b.scores[group] = future.result()[i]
    return value

  def _rewards(self, b: _Batch) -> Any:
    """The batch's rewards [R] (or named components), group by group."""
    groups = [self._score_of(b, g) for g in range(len(b.seq_ids))]
    return jax.tree.map(lambda *x: np.concatenate(x), *groups)

  def _assemble(self, b: _Batch) -> tuple[dict[str, jax.Array], Generation, np.ndarray]:
    """The batch's training rows and Generation, placed on the mesh, and each token's policy version [R, N] (-1 pad).

    Recording routes, the rows hold them (`rollout_batch`'s `routes`): each completion's context from its
    prompt's first column on.
    """
    G, N, R = self._spec.grpo.group_size, self._spec.max_new_tokens, b.prompts.shape[0] * self._spec.grpo.group_size
    P, model = b.prompts.shape[1], self._spec.model
    tokens, log_probs = np.full((R, N), self._spec.pad_id, np.int32), np.zeros((R, N), np.float32)
    versions, lengths, finish = np.full((R, N), -1, np.int32), np.zeros((R,), np.int32), np.zeros((R,), np.int32)
    routes = (np.full((R, P + N, model.n_moe_layers, model.moe.experts_per_token), moe.NO_ROUTE, np.int16)
              if self._records_routes else None)
    for r, seq_id in enumerate(s for ids in b.seq_ids for s in ids):
      c = b.done[seq_id]
      n = len(c.tokens)
      tokens[r, :n], log_probs[r, :n], versions[r, :n] = c.tokens, c.log_probs, c.policy_versions
      lengths[r], finish[r] = n, c.finish_reason
      if routes is not None:  # the prompt and every sampled token but the last
        first = P - int(b.lengths[r // G])
        routes[r, first:first + len(c.routes)] = c.routes
    gen = Generation(tokens=tokens, lengths=lengths, finish_reasons=finish, log_probs=log_probs, routes=routes)
    rows = jax.tree.map(np.asarray, rollout_batch(b.prompts, b.lengths, gen, G))
    gen = dataclasses.replace(gen, routes=None)  # the rows hold them
    placed = to_global({"rows": rows, "gen": dataclasses.asdict(gen)}, self._mesh, self._spec.rules)
    return placed["rows"], Generation(**placed["gen"]), versions


def _flat(arrays: list[np.ndarray], dtype) -> np.ndarray:
  """The arrays end to end (their lengths are saved beside them)."""
  return np.concatenate([np.asarray(a, dtype) for a in arrays]) if arrays else np.zeros((0,), dtype)


def _flat_routes(routes: list[np.ndarray], model: ModelConfig) -> dict[str, np.ndarray]:
  """Completions' routes [c, L, k] end to end, with each one's c: a checkpoint's `routes` and `routes_lengths`."""
  empty = np.zeros((0, model.n_moe_layers, model.moe.experts_per_token), np.int16)
  return {"routes": np.concatenate(routes) if routes else empty,
          "routes_lengths": np.asarray([len(r) for r in routes], np.int32)}
