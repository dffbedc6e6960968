"""Host rewards: scores a batch of completions with an environment, concurrently.

This is what GRPO's host-reward mode calls on batch k while the device samples
batch k+1, and what the evaluation harness uses for every turn. Each step runs
in a thread under a `ptx.rl.scheduler.Scheduler` (sandboxed programs block), so
up to `concurrency` programs run at once (a step that timed out keeps its slot
until its thread has returned: threads cannot be stopped); steps whose result is
an infrastructure fault are retried, and a step that raises, or outlives the
optional timeout, is scored as an infrastructure error (the environment failed,
not the model), never as wrong. Where the steps run is the scheduler's
executor: in this process by default, or as Ray tasks on CPU nodes
(`ptx.rl.ray_executor`), where each step call must pickle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ptx.rl.environments.base import Environment, Outcome, Step
from ptx.rl.executors import Executor
from ptx.rl.scheduler import Job, Scheduler, to_thread


def run_steps(steps: Sequence[Callable[[], Step]], concurrency: int = 32, *, timeout_s: float | None = None,
              executor: Executor | None = None, priorities: Sequence[int] | None = None) -> list[Step]:
  """Runs blocking step calls, `concurrency` at once, and returns their Steps in order.

  Args:
    steps: zero-argument calls, each returning a Step (usually `episode.step(action)`).
    concurrency: most calls running at once, counting calls that timed out but have not returned.
    timeout_s: seconds a call may run, from its start, before it is scored as an infrastructure
      error (None: no limit). Its thread goes on until the call returns (it may watch
      `ptx.rl.scheduler.abandoned()` to stop early), keeping its slot, and run_steps returns
      only once every call has returned.
    executor: where the calls run (`ptx.rl.executors`; with Ray each call must pickle); None: here.
    priorities: the scheduler priority of each call (higher starts first); None: all equal.

  Returns:
    One Step per call.
  """
  priorities = [0] * len(steps) if priorities is None else priorities
  if len(priorities) != len(steps):
    raise ValueError(f"rewards.run_steps: {len(priorities)} priorities for {len(steps)} steps")

  async def main(pool: concurrent.futures.Executor) -> list[Step]:
    # A job's thread comes from its loop's default executor: `pool` here, the node's own where Ray runs it.
    asyncio.get_running_loop().set_default_executor(pool)
    async with Scheduler(concurrency, timeout_s=timeout_s, executor=executor) as scheduler:
      results = await scheduler.run(Job(functools.partial(to_thread, s), key=i, priority=p)
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
    raise ValueError(f"rewards.score: {len(tasks)} tasks but {len(completions)} completions")
  if env.max_turns != 1:
    raise ValueError(f"rewards.score: {env.name} is multi-turn ({env.max_turns} turns); play it with "
                     "evaluation.evaluate_episodes")
  episodes = [env.reset(task) for task in tasks]
  try:
    return run_steps([functools.partial(e.step, c) for e, c in zip(episodes, completions)], concurrency,
                     timeout_s=timeout_s, executor=executor, priorities=priorities)
  finally:
    for episode in episodes:
      episode.close()
