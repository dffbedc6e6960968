"""Host rewards: scores a batch of completions with an environment, concurrently; `EnvReward` as GRPO calls it.

This is what GRPO's host-reward mode calls on batch k while the device samples
batch k+1, and what the evaluation harness uses for every turn. Each step runs
in a thread under a `ptx.scheduling.scheduler.Scheduler` (sandboxed programs block), so
up to `concurrency` programs run at once (a step that timed out keeps its slot
until its thread has returned: threads cannot be stopped); steps whose result is
an infrastructure fault are retried, and a step that raises, or outlives the
optional timeout, is scored as an infrastructure error (the environment failed,
not the model), never as wrong. Where the steps run is the scheduler's
executor: in this process by default, or as Ray tasks on CPU nodes
(`ptx.scheduling.ray_executor`), where each step call must pickle.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ptx.data.tokenizer import Tokenizer
from ptx.envs.base import Environment, Outcome, Step, sandbox_backend
from ptx.scheduling.executors import Executor
from ptx.scheduling.priority import PriorityPolicy
from ptx.scheduling.scheduler import Scheduler, to_thread
from ptx.scheduling.work import Work


def run_steps(steps: Sequence[Callable[[], Step]], concurrency: int = 32, *, timeout_s: float | None = None,
              executor: Executor | None = None, priorities: Sequence[int] | None = None) -> list[Step]:
  """Runs blocking step calls, `concurrency` at once, and returns their Steps in order.

  Args:
    steps: zero-argument calls, each returning a Step (usually `episode.step(action)`).
    concurrency: most calls running at once, counting calls that timed out but have not returned.
    timeout_s: seconds a call may run, from its start, before it is scored as an infrastructure
      error (None: no limit). Its thread goes on until the call returns (it may watch
      `ptx.scheduling.scheduler.abandoned()` to stop early), keeping its slot, and run_steps returns
      only once every call has returned.
    executor: where the calls run (`ptx.scheduling.executors`; with Ray each call must pickle); None: here.
    priorities: the scheduler priority of each call (higher starts first); None: all equal.

  Returns:
    One Step per call.
  """
  priorities = [0] * len(steps) if priorities is None else priorities
  if len(priorities) != len(steps):
    raise ValueError(f"scoring.run_steps: {len(priorities)} priorities for {len(steps)} steps")

  async def main(pool: concurrent.futures.Executor) -> list[Step]:
    # A job's thread comes from its loop's default executor: `pool` here, the node's own where Ray runs it.
    asyncio.get_running_loop().set_default_executor(pool)
    async with Scheduler(concurrency, timeout_s=timeout_s, executor=executor) as scheduler:
      results = await scheduler.run(Work(functools.partial(to_thread, s), key=i, priority=p)
                                    for i, (s, p) in enumerate(zip(steps, priorities)))
    return [r.value if isinstance(r.value, Step)
            else Step.final(Outcome.INFRA_ERROR, f"scoring failed: {r.error}") for r in results]

  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    try:
      asyncio.get_running_loop()
    except RuntimeError:
      return asyncio.run(main(pool))
    # Called from a running loop (a notebook): give the scheduler a thread of its own.
    with concurrent.futures.ThreadPoolExecutor(1) as runner:
      return runner.submit(asyncio.run, main(pool)).result()


def score(env: Environment, tasks: Sequence[Mapping[str, Any]], completions: Sequence[str], *,
          concurrency: int = 32, timeout_s: float | None = None, executor: Executor | None = None,
          priorities: Sequence[int] | None = None) -> list[Step]:
  """Scores one completion per task with a single-turn environment.

  Args:
    env: the environment (its episodes must finish in one step).
    tasks: task records, one per completion (repeat a record for a group).
    completions: the model's outputs.
    concurrency: most episodes scored at once.
    timeout_s: seconds a step may run before it is scored as an infrastructure error (None: no limit).
    executor: where the steps run (`run_steps`); None: here.
    priorities: the scheduler priority of each completion's step; None: all equal.

  Returns:
    The final Step of each episode: reward, outcome and reason.
  """
  if len(tasks) != len(completions):
    raise ValueError(f"scoring.score: {len(tasks)} tasks but {len(completions)} completions")
  if env.max_turns != 1:
    raise ValueError(f"scoring.score: {env.name} is multi-turn ({env.max_turns} turns); play it with "
                     "evaluation.evaluate_episodes")
  episodes = [env.reset(task) for task in tasks]
  try:
    return run_steps([functools.partial(e.step, c) for e, c in zip(episodes, completions)], concurrency,
                     timeout_s=timeout_s, executor=executor, priorities=priorities)
  finally:
    for episode in episodes:
      episode.close()


# reward(tokens [R, N], lengths [R], tasks of the B prompts) -> float32 [R], or named components {name: [R]};
# NaN where unscorable.
HostReward = Callable[[np.ndarray, np.ndarray, Any], Any]


def decode_completions(tokenizer: Tokenizer, tokens: np.ndarray, lengths: np.ndarray,
                       stop_ids: Sequence[int]) -> list[str]:
  """The text of each row's first `lengths` tokens [R, N], stop ids left out: what a host reward scores."""
  stops = set(stop_ids)
  return [tokenizer.decode([int(t) for t in row[:n] if t not in stops]) for row, n in zip(tokens, lengths)]


class _OutcomeTally:
  """Episode outcomes counted since the last `take` (thread-safe: refills score from the step's thread)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counts: collections.Counter[str] = collections.Counter()

  def add(self, outcomes: Sequence[Outcome]) -> None:
    with self._lock:
      self._counts.update(str(o) for o in outcomes)

  def take(self) -> dict[str, float]:
    """The fraction of each outcome (every label, 0 included), then starts afresh; {} when nothing was scored."""
    with self._lock:
      counts, self._counts = self._counts, collections.Counter()
    total = sum(counts.values())
    if not total:
      return {}
    fracs = {f"rewards/outcome/{o}_frac": counts[str(o)] / total for o in Outcome}
    return {**fracs, "rewards/infra_error_frac": fracs[f"rewards/outcome/{Outcome.INFRA_ERROR}_frac"]}


@dataclasses.dataclass(frozen=True)
class EnvReward:
  """A HostReward that decodes each completion and scores it in a single-turn environment.

  A sample the environment failed to score (infrastructure error, after the
  scheduler's retries) gets a NaN reward: it is left out of its group's
  statistics and of the loss, and counted in `rewards/infra_error_frac`.
  Building one for a sandboxed environment raises
  `ptx.sandbox.run.SandboxUnavailable` when no sandbox backend works here.

  Attributes:
    env: the environment (e.g. `ExactAnswerEnv()`).
    tokenizer: decodes the completions (not compared: it is the job's data side).
    stop_ids: ids left out of the decoded text.
    group_size: samples per task (G).
    concurrency: environment instances scored at once.
    timeout_s: seconds a sample's scoring may run before it is an infrastructure error (None: no limit; with a
      remote executor set one, so a job lost without word from its cluster cannot stall training).
    executor: where the episodes are scored (`ptx.scheduling.executors`; `ptx.scheduling.ray_executor.RayExecutor`:
      on a Ray cluster's CPU nodes); None: in this process.
    priority: orders the samples' scoring under contention (`ptx.scheduling.priority`); None: in batch order.
  """

  env: Environment
  tokenizer: Tokenizer = dataclasses.field(compare=False)
  stop_ids: tuple[int, ...]
  group_size: int
  concurrency: int = 32
  timeout_s: float | None = None
  executor: Executor | None = dataclasses.field(default=None, compare=False)
  priority: PriorityPolicy | None = dataclasses.field(default=None, compare=False)
  tally: _OutcomeTally = dataclasses.field(default_factory=_OutcomeTally, compare=False, repr=False)

  def __post_init__(self):
    sandbox_backend(self.env)  # refuses now, naming the fix, rather than at the first step

  def __call__(self, tokens: np.ndarray, lengths: np.ndarray, tasks: Sequence[dict[str, Any]]) -> np.ndarray:
    texts = decode_completions(self.tokenizer, tokens, lengths, self.stop_ids)
    per_sample = [t for t in tasks for _ in range(self.group_size)]
    priorities = None if self.priority is None else [self.priority.priority(t) for t in per_sample]
    steps = score(self.env, per_sample, texts, concurrency=self.concurrency, timeout_s=self.timeout_s,
                  executor=self.executor, priorities=priorities)
    self.tally.add([s.outcome for s in steps])
    rewards = np.asarray([np.nan if s.outcome == Outcome.INFRA_ERROR else s.reward for s in steps], np.float32)
    if self.priority is not None:
      for task, group in zip(tasks, rewards.reshape(len(tasks), self.group_size)):
        self.priority.record(task, group)
    return rewards

  def take_metrics(self) -> dict[str, Any]:
    """Outcome fractions of the batches scored since the last call, and the sandbox backend that ran them."""
    metrics = self.tally.take()
    backend = sandbox_backend(self.env) if metrics else None
    if backend is not None:
      metrics["rewards/sandbox"] = backend
    return metrics
