"""GRPO's host-reward mode: the device samples batch k + s while the host scores batch k.

When the reward needs the host (a Python verifier, sandboxed code through
`ptx.episodes.scoring`), one RL step is two programs built from the fused step's
pieces (`ptx.train.grpo.update.sample` and `learn`): a sampling program and an
update program, both on the same mesh and the same parameter arrays. Step k
dispatches the sampling of prompt batch k + s (read ahead from the prompt
stream, `Lookahead`) with the current parameters, then fetches batch k's
tokens, scores them on the host while the device samples, and dispatches
batch k's update. Batch k was sampled s updates ago: with `max_staleness` s
> 0 PPO's old log-probs are recomputed at the current parameters and the
truncated importance weight exp(old - sampler) corrects for the stale
behaviour policy (decoupled PPO); s = 0 is on-policy and computes exactly
what the fused step computes.

Metrics add, per step: `timing_s/step` (wall), `timing_s/generate` (the host
waiting for batch k's tokens), `timing_s/reward` (host scoring),
`perf/device_wait_frac` (the fraction of the step's wall time during which
the device had no work queued) and `rollout/staleness`; a reward with
`take_metrics()` (`EnvReward`) adds its own: the fraction of each episode
outcome, `rewards/infra_error_frac` (samples left out of their group's
statistics because the environment failed, not the model), and
`rewards/sandbox`, the backend that ran the model's code. Checkpoints hold
the s batches sampled ahead (`pipeline_state`), and a resumed run trains on
them as the uninterrupted run does, so resume is exact for every s.

With `filter_groups="refill"` (DAPO dynamic sampling) a step whose batch has
fewer than B groups with signal takes the pipeline's next batches (consumed
from the stream) for up to `max_refill_rounds` rounds and trains on B
kept groups; slots left free are masked out of the loss.

Transcripts (`ptx.train.grpo.samples`): a step that `grpo.samples_every`
selects keeps its first rows, the ones it trains on (after a refill, the
kept groups), decoded by the Job's tokenizer.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from ptx.algorithms import advantages as adv_lib
from ptx.algorithms import dynamic_sampling
from ptx.data.global_batch import to_global
from ptx.data.lookahead import Lookahead
from ptx.episodes.scoring import HostReward
from ptx.data.tokenizer import Tokenizer
from ptx.sampling.generation import Generation
from ptx.train.grpo.samples import SampleLog, rows_of
from ptx.train.grpo.update import GRPOStepKind, RLSpec, jit_learn, rollout_batch, sample, step_keys
from ptx.train.state import TrainState
from ptx.train.step import model_params


@dataclasses.dataclass(frozen=True)
class HostGRPOStep(GRPOStepKind):
  """The host-reward GRPO step of a Job: `spec`, a host `reward`, the transcripts' tokenizer; it reads ahead."""

  reward: HostReward
  tokenizer: Tokenizer | None = dataclasses.field(default=None, compare=False)

  def stream(self, data: Iterator[dict[str, Any]]) -> Lookahead:
    """The prompt iterator as `fit` reads it: a `Lookahead`, which the step peeks to sample ahead."""
    return Lookahead.of(data)

  def build(self, optimizer: optax.GradientTransformation, mesh: Mesh, state_shardings: TrainState,
            data: Lookahead) -> "HostRewardStep":
    """The step object for `fit`, sampling ahead of `data` (`stream`'s); it checkpoints its batches sampled ahead."""
    return HostRewardStep(spec=self.spec, optimizer=optimizer, mesh=mesh, state_shardings=state_shardings,
                          reward=self.reward, prompts=data, tokenizer=self.tokenizer)


@dataclasses.dataclass
class _Pending:
  """A sampled batch on its way: the `index`-th dispatched (its sampling key), at step `sampled_at`."""

  index: int
  sampled_at: int
  rollouts: dict[str, jax.Array]
  gen: Any
  task: Any


class HostRewardStep:
  """`step(state, batch) -> (state, metrics)` of the host-reward mode, for `ptx.train.loop.fit`.

  Args:
    spec: the static step description (shared with the fused step).
    optimizer: the optax transformation of the state.
    mesh: the device mesh.
    state_shardings: the state's shardings.
    reward: scores a batch on the host (one reward, or named components).
    prompts: the prompt stream `fit` also reads (its `next` gives the
      step's batch; the step peeks the next `max_staleness`).
    tokenizer: decodes the transcripts' rows (None: no transcripts).
  """

  def __init__(self, *, spec: RLSpec, optimizer: optax.GradientTransformation, mesh: Mesh,
               state_shardings: TrainState, reward: HostReward, prompts: Lookahead, tokenizer: Tokenizer | None = None):
    self.staleness = spec.grpo.max_staleness
    self._spec, self._mesh, self._reward, self._prompts = spec, mesh, reward, prompts
    self._samples = SampleLog(spec.grpo, tokenizer)

    def sample_fn(state, prompts, lengths, step):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        gen = sample(model_params(state, spec.lora), prompts, lengths, step_keys(state.replace(step=step))[0], spec)
        return rollout_batch(prompts, lengths, gen, spec.grpo.group_size), dataclasses.replace(gen, routes=None)

    self._sample = jax.jit(sample_fn, in_shardings=(state_shardings, None, None, None))
    self._learn = jit_learn(spec, optimizer, mesh, state_shardings, proximal=self.staleness > 0)
    self._pending: collections.deque[_Pending] = collections.deque()
    self._resumed: dict[str, Any] | None = None  # a checkpoint's pipeline, placed at the next step
    self._next_step: int | None = None
    self._dispatched = 0
    self._watch = _Watch()
    self._last_return: float | None = None

  def __call__(self, state: TrainState, batch: dict[str, Any]) -> tuple[TrainState, dict[str, Any]]:
    start = time.perf_counter()
    if self._next_step is None:  # a fresh or resumed pipeline
      self._next_step = self._dispatched = int(state.step)
      if self._resumed is not None:
        self._pending.extend(self._place_resumed(state, batch))
    if not self._pending:  # nothing sampled ahead (on-policy, or the first step): sample this batch now
      self._pending.append(self._dispatch(state, batch))
    k = self._next_step
    entry = self._pending.popleft()
    self._fill(state)
    fetched = time.perf_counter()
    tokens, lengths = jax.device_get((entry.gen.tokens, entry.gen.lengths))
    scored = time.perf_counter()
    rewards = self._score(tokens, lengths, entry.task)
    done = time.perf_counter()
    rollouts, gen, filter_metrics = entry.rollouts, entry.gen, {}
    if self._spec.grpo.filter_groups == "refill":
      rollouts, gen, rewards, filter_metrics = self._refill(state, entry, rewards)
      done = time.perf_counter()
    self._watch.dispatching(done)
    if self._samples.due(k + 1):
      self._samples.keep(k + 1, rows_of(rollouts, gen, rewards, self._samples.rows), self._spec.grpo.group_size)
    state, metrics = self._learn(state, rollouts, gen, jax.tree.map(jnp.asarray, rewards))
    self._watch.start(metrics["loss"])
    self._next_step = k + 1
    wall_start = start if self._last_return is None else self._last_return
    end = time.perf_counter()
    wall = end - wall_start
    self._last_return = end
    take = getattr(self._reward, "take_metrics", None)
    reward_metrics = take() if take is not None else {}
    metrics = {**metrics, **filter_metrics, **reward_metrics, "timing_s/step": wall,
               "timing_s/generate": scored - fetched, "timing_s/reward": done - scored,
               "perf/device_wait_frac": min(self._watch.take_idle() / wall, 1.0),
               "rollout/staleness": float(k - entry.sampled_at)}
    return state, metrics

  @property
  def learner(self) -> Any:
    """The jitted update program the step runs: (state, rollouts, gen, rewards) -> (state, metrics), state donated."""
    return self._learn

  def compile(self, state: TrainState, batch: dict[str, Any],
              compiler_options: dict[str, Any] | None = None) -> dict[str, jax.stages.Compiled]:
    """The sampling and update programs compiled for `state` and a global prompt batch, not run.

    The update is compiled for the sampler's outputs as it lays them out and
    one float32 reward per row (a reward of named components adds a few
    [R] arrays). `state` and the batch may be ShapeDtypeStructs.
    """
    index = jax.ShapeDtypeStruct((), jnp.int32)
    sample = self._sample.lower(state, batch["prompts"], batch["prompt_lengths"], index).compile(compiler_options)
    rollouts, gen = jax.tree.map(lambda out, s: jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=s),
                                 sample.out_info, sample.output_shardings)
    rewards = jax.ShapeDtypeStruct(gen.lengths.shape, jnp.float32)
    return {"sample": sample, "learn": self._learn.lower(state, rollouts, gen, rewards).compile(compiler_options)}

  def take_samples(self, wait: bool = False) -> dict[int, bytes]:
    """The transcripts of the steps that kept rows (`ptx.train.grpo.samples.SampleLog.take`), by step."""
    return self._samples.take(wait)

  def pipeline_state(self) -> dict[str, Any] | None:
    """The batches sampled ahead, as host arrays for a checkpoint (None when there are none).

    Fetching them waits for their sampling to finish; `fit` calls this only
    on checkpoint steps. Every process calls it (the arrays are gathered).
    """
    if not self._pending:
      return None
    batches = multihost_utils.process_allgather(
        {str(i): {"rollouts": p.rollouts, "gen": _fields(p.gen)} for i, p in enumerate(self._pending)}, tiled=True)
    return {"batches": batches, "dispatched": np.int64(self._dispatched),
            "index": np.asarray([p.index for p in self._pending], np.int64),
            "sampled_at": np.asarray([p.sampled_at for p in self._pending], np.int64)}

  def set_pipeline_state(self, saved: dict[str, Any]) -> None:
    """Takes back a checkpoint's batches sampled ahead; the next step places them on the mesh."""
    self._resumed = saved

  def _place_resumed(self, state: TrainState, batch: dict[str, Any]) -> list[_Pending]:
    """The resumed pipeline's entries as global arrays; pending batch i is the stream's next item i.

    One throw-away sampling of `batch` gives the shardings the sampler's
    outputs take on this mesh, so the update program sees the arrays it saw
    before the interruption.
    """
    saved, self._resumed = self._resumed, None
    rollouts, gen = self._sample(state, batch["prompts"], batch["prompt_lengths"], jnp.int32(0))
    like = {"rollouts": rollouts, "gen": _fields(gen)}
    place = lambda host, ref: jax.make_array_from_callback(host.shape, ref.sharding, lambda i: np.asarray(host)[i])
    entries = []
    for i in range(len(saved["index"])):
      arrays = jax.tree.map(place, saved["batches"][str(i)], like)
      task = batch["task"] if i == 0 else self._prompts.peek(i - 1)["task"]
      entries.append(_Pending(index=int(saved["index"][i]), sampled_at=int(saved["sampled_at"][i]),
                              rollouts=arrays["rollouts"], gen=Generation(**arrays["gen"]), task=task))
    self._dispatched = int(saved["dispatched"])
    return entries

  def _score(self, tokens: np.ndarray, lengths: np.ndarray, task: Any) -> Any:
    """The host reward of a batch as float32 arrays [R] (one, or one per named component)."""
    return jax.tree.map(lambda r: np.asarray(r, np.float32), self._reward(tokens, lengths, task))

  def _signal(self, rewards: Any) -> np.ndarray:
    """Groups [B] whose (weighted total) reward is not constant."""
    total = adv_lib.total_reward(rewards, self._spec.grpo.reward_weights)
    return np.asarray(adv_lib.groups_with_signal(jnp.asarray(total), self._spec.grpo.group_size))

  def _fill(self, state: TrainState) -> None:
    """Keeps `max_staleness` batches sampling ahead (pending batch i is the stream's next item i)."""
    while len(self._pending) < self.staleness:
      batch = to_global(self._prompts.peek(len(self._pending)), self._mesh, self._spec.rules)
      self._pending.append(self._dispatch(state, batch))

  def _refill(self, state: TrainState, entry: _Pending, rewards: Any):
    """DAPO dynamic sampling (`ptx.algorithms.dynamic_sampling`): groups with signal from further batches.

    Each extra batch is the pipeline's next one (consumed from the stream),
    for up to `max_refill_rounds` rounds or until B groups are kept.
    """
    G, cfg = self._spec.grpo.group_size, self._spec.grpo
    B = entry.gen.lengths.shape[0] // G
    by_group = lambda tree: jax.tree.map(lambda x: jnp.asarray(x).reshape(B, G, *x.shape[1:]), tree)
    rows = lambda p, r: by_group({"rollouts": p.rollouts, "gen": p.gen, "rewards": r})
    signal = self._signal(rewards)
    kept = dynamic_sampling.place(dynamic_sampling.start(rows(entry, rewards)), rows(entry, rewards), signal)
    rounds, with_signal = 1, int(signal.sum())
    while int(kept.count) < B and rounds <= cfg.max_refill_rounds:
      if not self._pending:
        self._pending.append(self._dispatch(state, to_global(self._prompts.peek(0), self._mesh, self._spec.rules)))
      self._prompts.skip()
      extra = self._pending.popleft()
      tokens, lengths = jax.device_get((extra.gen.tokens, extra.gen.lengths))
      extra_rewards = self._score(tokens, lengths, extra.task)
      extra_signal = self._signal(extra_rewards)
      kept = dynamic_sampling.place(kept, rows(extra, extra_rewards), extra_signal)
      rounds, with_signal = rounds + 1, with_signal + int(extra_signal.sum())
      self._fill(state)
    flat, keep = dynamic_sampling.flat(kept)
    metrics = dynamic_sampling.metrics(kept, sampled=rounds * B, with_signal=with_signal, rounds=rounds)
    return {**flat["rollouts"], "keep": keep}, flat["gen"], flat["rewards"], jax.device_get(metrics)

  def _dispatch(self, state: TrainState, batch: dict[str, Any]) -> _Pending:
    """Queues the sampling of `batch` with the current parameters."""
    self._watch.dispatching(time.perf_counter())
    index, self._dispatched = self._dispatched, self._dispatched + 1
    rollouts, gen = self._sample(state, batch["prompts"], batch["prompt_lengths"], jnp.int32(index))
    self._watch.start(gen.lengths)
    return _Pending(index=index, sampled_at=self._next_step, rollouts=rollouts, gen=gen, task=batch["task"])


def _fields(gen: Generation) -> dict[str, jax.Array]:
  """A Generation's arrays by field name (the form a checkpoint stores; a field that is None is left out)."""
  return {f.name: getattr(gen, f.name) for f in dataclasses.fields(gen) if getattr(gen, f.name) is not None}


class _Watch:
  """Device idle time: from the moment the last queued work finished to the next dispatch."""

  def __init__(self):
    self._done_at: float | None = None
    self._thread: threading.Thread | None = None
    self._idle = 0.0

  def start(self, output: jax.Array) -> None:
    """Watches the newest dispatched work (queued after everything before it)."""
    self._done_at = None

    def wait():
      jax.block_until_ready(output)
      self._done_at = time.perf_counter()

    self._thread = threading.Thread(target=wait, daemon=True)
    self._thread.start()

  def dispatching(self, now: float) -> None:
    """Adds the idle gap before a dispatch at `now`, if the queue had drained by then."""
    done_at = self._done_at
    if self._thread is not None and done_at is not None and done_at < now:
      self._idle += now - done_at
    self._thread = None

  def take_idle(self) -> float:
    idle, self._idle = self._idle, 0.0
    return idle

