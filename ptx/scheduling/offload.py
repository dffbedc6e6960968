"""Blocking calls from host threads, run where an executor runs jobs: an environment's steps on a cluster.

An episode's `step` is called on a host thread (`ptx.episodes.loop`) and
must return its answer. `Offload.call(fn, *args)` runs `fn(*args)` (a pure
function, blocking) and returns what it returns: without an executor in the
calling thread, directly, as environments always have; with one as a job of
the Offload's own `ptx.scheduling.scheduler.Scheduler` (its concurrency limit,
per-call timeout, and retries of infrastructure faults), on that executor
(`ptx.scheduling.ray_executor`: a Ray task on a CPU node), the calling thread waiting
for the result. With `keep=True`, `fn` returns `(value, kept)` and the call
`(value, handle)`: the handle stays where the executor keeps it (Ray's
object store) and goes into a later call's `args`, so state passed from call
to call (a workspace's snapshot) is not shipped through the trainer each time
(`ptx.scheduling.executors`).

Failures: a call that did not return, because it raised `InfraError` (or
anything else) on every attempt, ran past the timeout, or its node was lost
past the retries, raises `InfraError` here: never a result the caller could
mistake for the work's own. `fn` must not return None (None is how a job
that returned nothing comes back). Inside `fn`, raise `InfraError` for what
is the infrastructure's fault, so the executor's path retries it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ptx.scheduling import scheduler
from ptx.scheduling.executors import Executor


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
  """The job of one call: `fn(*args)` on a thread of the loop running it (module-level, so that it pickles)."""
  return await scheduler.to_thread(fn, *args)


class Offload:
  """Runs blocking calls in the calling thread, or as scheduler jobs on an executor.

  Args:
    executor: where calls run (`ptx.scheduling.executors`); None: in the calling thread, directly (no scheduler).
    concurrency: calls running at once on the executor.
    timeout_s: seconds one attempt may take on the executor, queueing there included (None: no limit).
    retry: retries of a call's infrastructure faults on the executor.
  """

  def __init__(self, executor: Executor | None = None, *, concurrency: int = 32, timeout_s: float | None = None,
               retry: scheduler.Retry = scheduler.Retry()):
    self.executor = executor
    self._options = {"concurrency": concurrency, "timeout_s": timeout_s, "retry": retry}
    self._lock = threading.Lock()
    self._loop: asyncio.AbstractEventLoop | None = None
    self._scheduler: scheduler.Scheduler | None = None
    self._stop: weakref.finalize | None = None

  def call(self, fn: Callable[..., Any], *args: Any, keep: bool = False) -> Any:
    """`fn(*args)`, where the executor runs it; blocks until it returns.

    Args:
      fn: a pure, blocking function; on a remote executor it must pickle (module-level, or a partial of one).
      *args: its arguments: values, or handles earlier keeping calls returned.
      keep: `fn` returns (value, kept): return (value, a handle of kept) and leave kept where it was made.

    Returns:
      What `fn` returned, or (value, handle) with `keep`.

    Raises:
      scheduler.InfraError: on the executor, the call did not return (retries spent, timed out, crashed, lost).
    """
    if self.executor is None:
      return fn(*args)
    name = getattr(fn, "func", fn).__name__  # a partial's function: the job's name in results and messages
    job = scheduler.Work(functools.partial(_in_thread, fn), key=name, args=args, keeps=keep)
    loop, jobs = self._started()
    result = asyncio.run_coroutine_threadsafe(_submit(jobs, job), loop).result()
    if result.value is None:
      raise scheduler.InfraError(f"{result.key} did not return on {type(self.executor).__name__} after "
                                 f"{result.attempts} attempt(s): {result.outcome} {result.error}".rstrip())
    return result.value

  def fetch(self, handle: Any) -> Any:
    """The value behind a handle a keeping call returned, here."""
    return handle if self.executor is None else self.executor.fetch(handle)

  def close(self) -> None:
    """Cancels the calls still running on the executor and stops the loop (a later call starts it again)."""
    with self._lock:
      stop, self._stop, self._loop, self._scheduler = self._stop, None, None, None
    if stop is not None:
      stop()

  def __reduce__(self):
    """Pickles as its settings (an environment sent to a node): a new Offload there, no loop or calls in flight."""
    return functools.partial(Offload, self.executor, **self._options), ()

  def _started(self) -> tuple[asyncio.AbstractEventLoop, scheduler.Scheduler]:
    """The loop thread and the scheduler, started at the first call (an environment built and never played
    starts nothing)."""
    with self._lock:
      if self._loop is None:
        self._loop = asyncio.new_event_loop()
        self._scheduler = scheduler.Scheduler(executor=self.executor, **self._options)
        threading.Thread(target=self._loop.run_forever, name="ptx-offload", daemon=True).start()
        # Stopped when this Offload is collected or the interpreter exits, if not closed before: an environment
        # lives as long as its run, and nobody closes it.
        self._stop = weakref.finalize(self, _stop, self._loop, self._scheduler)
      return self._loop, self._scheduler


def _stop(loop: asyncio.AbstractEventLoop, jobs: scheduler.Scheduler) -> None:
  """Closes the scheduler in its loop (cancelling what still runs), then stops the loop."""
  asyncio.run_coroutine_threadsafe(jobs.close(), loop).result()
  loop.call_soon_threadsafe(loop.stop)


async def _submit(jobs: scheduler.Scheduler, job: scheduler.Work) -> scheduler.WorkResult:
  """Submits `job` in the scheduler's loop and waits for its result."""
  return await jobs.submit(job)
