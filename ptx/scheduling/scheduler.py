"""Runs many environment instances concurrently: limit, priorities, timeouts, retries.

A job is a zero-argument callable returning an awaitable (called again for each
retry). At most `concurrency` attempts are in flight; the queued job with the
highest priority starts next (ties: first submitted first). Each attempt may
have a timeout, counted from the moment the attempt starts running (never from
submission or time spent queued). Only infrastructure faults are retried, with
exponential backoff and jitter: an attempt that raises `InfraError`, or returns
a value whose `outcome` is "infra_error". A wrong answer, a crash or a timeout
is a result, never a reason to try again.

Every job ends with exactly one `WorkResult` whose outcome is the value's
`outcome` attribute when it has one (a SandboxResult, an environment Step) and
"ok" otherwise; or "timeout", "crashed" (it raised anything at all, BaseExceptions
such as SystemExit, GeneratorExit or a CancelledError of its own included),
"infra_error" (retries spent) or "cancelled" (the caller cancelled its future,
or `cancel()` / `close()` ended it). `Scheduler.counts` tallies them.

Work that blocks (a sandbox run) belongs in this module's `to_thread` inside the
job, not `asyncio.to_thread`: a thread cannot be stopped, so when an attempt
times out or is cancelled its result is reported at once but its slot stays
taken until the call has really returned. `concurrency` thus bounds the blocking
calls actually running, and a started attempt never waits for a thread held by
an earlier one. A call may watch `abandoned()` to give up early. `hold` does the
same for any work running outside the loop (a remote task).

Where an attempt runs is the executor's choice (`ptx.scheduling.executors`): in this
loop by default, or as a Ray task on a CPU node (`ptx.scheduling.ray_executor`); every
rule above stays here, whichever runs it.

A deadline is judged by the attempt's own running time, not by the order in
which a stalled loop catches up (see `Scheduler._deadline`).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import itertools
import random
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ptx.scheduling.executors import Executor, LocalExecutor
from ptx.scheduling.work import INFRA_ERROR, InfraError, Retry, Work, WorkResult

# A deadline timer that runs later than this after its time was held up: a blocking callback,
# another thread holding the GIL, the process not scheduled. An unhindered loop runs a timer
# within about a millisecond of its time.
_LATE_S = 0.01


@dataclasses.dataclass(eq=False)
class _Attempt:
  """One attempt in flight: its task, its deadline and the work it started outside the loop."""

  timeout_s: float | None
  pending: set[asyncio.Future]  # the scheduler's: everything close() waits for
  task: asyncio.Task | None = None
  timer: asyncio.TimerHandle | None = None  # its deadline
  credit: float = 0.0  # seconds the deadline may still move for a stalled loop
  calls: dict[asyncio.Future, Callable[[], None]] = dataclasses.field(default_factory=dict)  # running -> abandon

  def hold(self, future: asyncio.Future, abandon: Callable[[], None]) -> None:
    """Keeps the slot taken until `future` (a blocking call, a remote task) is done."""
    self.calls[future] = abandon
    self.pending.add(future)
    future.add_done_callback(self._returned)

  def _returned(self, future: asyncio.Future) -> None:
    self.calls.pop(future, None)
    self.pending.discard(future)
    if not future.cancelled():
      future.exception()  # seen by its awaiter, or wanted by nobody: either way not "never retrieved"

  def end(self) -> None:
    """The attempt is over: no deadline left, and no one wants what its calls still compute."""
    if self.timer is not None:
      self.timer.cancel()
    for abandon in self.calls.values():
      abandon()


_ATTEMPT: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar("ptx_scheduler_attempt",
                                                                            default=None)
_ABANDONED: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "ptx_scheduler_abandoned", default=None)


@dataclasses.dataclass(eq=False)
class _Entry:
  job: Work
  run: Callable[[], Awaitable[Any]]  # one attempt, where the executor runs it
  future: asyncio.Future
  seq: int
  attempts: int = 0
  task: asyncio.Task | None = None  # the attempt in flight
  timer: asyncio.TimerHandle | None = None  # a pending retry


class Scheduler:
  """Runs jobs under a concurrency limit; use as `async with Scheduler(...) as s`.

  Args:
    concurrency: most attempts in flight at once (an attempt that timed out or was cancelled
      stays in flight until the blocking calls it started with `to_thread` have returned).
    timeout_s: default per-attempt timeout (None: no limit).
    retry: backoff for infrastructure faults.
    seed: seeds the backoff jitter.
    executor: where attempts run (`ptx.scheduling.executors`); None: in this loop (`LocalExecutor`).
  """

  def __init__(self, concurrency: int, *, timeout_s: float | None = None, retry: Retry = Retry(),
               seed: int = 0, executor: Executor | None = None):
    if concurrency < 1:
      raise ValueError(f"Scheduler.concurrency must be >= 1, got {concurrency}")
    if timeout_s is not None and timeout_s <= 0:
      raise ValueError(f"Scheduler.timeout_s must be > 0 or None, got {timeout_s}")
    self.concurrency, self.timeout_s, self.retry = concurrency, timeout_s, retry
    self.executor = LocalExecutor() if executor is None else executor
    self.counts: collections.Counter[str] = collections.Counter()
    self.retries = 0  # attempts repeated after an infrastructure fault
    self.in_flight = 0
    self.max_in_flight = 0
    self._rng = random.Random(seed)
    self._seq = itertools.count()
    self._queue: asyncio.PriorityQueue | None = None
    self._workers: list[asyncio.Task] = []
    self._live: set[_Entry] = set()
    self._pending: set[asyncio.Future] = set()  # attempt tasks and blocking calls not yet done
    self._closed = False

  async def __aenter__(self) -> Scheduler:
    return self

  async def __aexit__(self, *exc) -> None:
    await self.close()

  def submit(self, job: Work) -> asyncio.Future:
    """Queues `job`; returns a future of its WorkResult. Cancelling the future cancels the job.

    Args:
      job: the work.

    Returns:
      An asyncio.Future that resolves to the WorkResult.

    Raises:
      TypeError: the executor cannot run the job (e.g. it does not pickle for Ray), naming its key.
    """
    if self._closed:
      raise RuntimeError("Scheduler.submit after close() or cancel()")
    if job.timeout_s is not None and job.timeout_s <= 0:
      raise ValueError(f"Work.timeout_s must be > 0 or None, got {job.timeout_s} (key {job.key!r})")
    run = self.executor.bind(job)
    if self._queue is None:
      self._queue = asyncio.PriorityQueue()
      self._workers = [asyncio.create_task(self._work()) for _ in range(self.concurrency)]
    entry = _Entry(job, run, asyncio.get_running_loop().create_future(), next(self._seq))
    entry.future.add_done_callback(lambda f: self._on_future_done(entry))
    self._live.add(entry)
    self._enqueue(entry)
    return entry.future

  async def run(self, jobs: Iterable[Work]) -> list[WorkResult]:
    """Submits `jobs` and waits for all of them.

    Args:
      jobs: the work.

    Returns:
      One WorkResult per job, in the order given.
    """
    return list(await asyncio.gather(*[self.submit(job) for job in jobs]))

  def cancel(self) -> None:
    """Ends every unfinished job with outcome "cancelled" and refuses new ones."""
    self._closed = True
    for entry in list(self._live):
      self._finish(entry, "cancelled", None, "cancelled by Scheduler.cancel()")

  async def close(self) -> None:
    """Cancels what is left, stops the workers and waits for the blocking calls still running.

    A thread cannot be stopped: its calls are told (`abandoned()`) and waited for, so none
    outlives the scheduler.
    """
    self.cancel()
    for worker in self._workers:
      worker.cancel()
    await asyncio.gather(*self._workers, return_exceptions=True)
    self._workers = []
    while self._pending:
      await asyncio.wait(list(self._pending))

  def _enqueue(self, entry: _Entry) -> None:
    entry.timer = None
    if not entry.future.done():
      self._queue.put_nowait((-entry.job.priority, entry.seq, entry))

  def _on_future_done(self, entry: _Entry) -> None:
    """Counts a job whose future the caller cancelled, and stops its work."""
    self._live.discard(entry)
    if entry.future.cancelled():
      self.counts["cancelled"] += 1
    if entry.timer is not None:
      entry.timer.cancel()
    if entry.task is not None:
      entry.task.cancel()

  def _finish(self, entry: _Entry, outcome: str, value: Any, error: str = "") -> None:
    if not entry.future.done():
      self.counts[outcome] += 1
      entry.future.set_result(WorkResult(entry.job.key, outcome, value, entry.attempts, error))

  async def _work(self) -> None:
    while True:
      _, _, entry = await self._queue.get()
      if entry.future.done():
        continue  # cancelled while it waited
      self.in_flight += 1
      self.max_in_flight = max(self.max_in_flight, self.in_flight)
      try:
        await self._attempt(entry)
      finally:
        self.in_flight -= 1

  async def _attempt(self, entry: _Entry) -> None:
    """Runs one attempt and reports it; returns once its slot is free (its threads have returned)."""
    entry.attempts += 1
    timeout_s = entry.job.timeout_s if entry.job.timeout_s is not None else self.timeout_s
    attempt = _Attempt(timeout_s, self._pending)
    context = contextvars.copy_context()
    context.run(_ATTEMPT.set, attempt)
    task = asyncio.get_running_loop().create_task(self._run(entry, attempt), context=context)
    attempt.task = entry.task = task
    self._pending.add(task)
    task.add_done_callback(self._pending.discard)
    try:
      # asyncio.wait, not `await task`: a stop of this worker stays apart from the attempt's own end.
      await asyncio.wait([task])
    except asyncio.CancelledError:  # this worker is being stopped (close())
      task.cancel()
      raise
    finally:
      attempt.end()
      entry.task = None
    self._report(entry, task)
    while attempt.calls:  # the slot stays taken until the attempt's blocking calls have returned
      await asyncio.wait(list(attempt.calls))

  async def _run(self, entry: _Entry, attempt: _Attempt) -> tuple[str, Any, str]:
    """The attempt's task: whatever the job raises ends here as (kind, value, detail).

    Only a cancellation from outside (the deadline, the job's future, a stopping worker) leaves
    as one; `cancelling()` tells it from a CancelledError the job raised by itself.
    """
    if attempt.timeout_s is not None:  # the clock starts now, when the attempt starts running
      attempt.credit = attempt.timeout_s
      attempt.timer = asyncio.get_running_loop().call_later(attempt.timeout_s, self._deadline, entry, attempt)
    try:
      value = await entry.run()
      return "value", value, str(getattr(value, "outcome", "ok"))
    except asyncio.CancelledError as e:
      if asyncio.current_task().cancelling():
        raise
      return "crashed", None, repr(e)
    except InfraError as e:
      return "fault", None, repr(e)
    except GeneratorExit as e:
      if not _stepping(attempt.task):
        raise  # this coroutine itself is being closed (collected unfinished), not a job's exception
      return "crashed", None, repr(e)
    except BaseException as e:  # noqa: BLE001  (a crashing job is a result, not our failure)
      return "crashed", None, repr(e)

  def _report(self, entry: _Entry, task: asyncio.Task) -> None:
    if entry.future.done():
      return  # already reported: timed out, or cancelled by the caller, cancel() or close()
    if task.cancelled():  # none of ours: the job cancelled its own task
      self._finish(entry, "crashed", None, "CancelledError() (the job cancelled itself)")
      return
    kind, value, detail = task.result()
    if kind == "fault":
      self._fault(entry, None, detail)
    elif kind == "crashed":
      self._finish(entry, "crashed", None, detail)
    elif detail == INFRA_ERROR:
      self._fault(entry, value, "")
    else:
      self._finish(entry, detail, value)

  def _deadline(self, entry: _Entry, attempt: _Attempt) -> None:
    """The attempt's timer: reports "timeout" and cancels it, unless the loop was held up.

    A finished attempt is never timed out, even if its worker has not resumed yet. When this
    callback itself runs late, the loop was blocked for at least that long just before it (a
    synchronous callback, the GIL held by other threads), and whatever the job finished in that
    time (a thread's result) is still queued behind this callback: judging now would let the
    order in which the loop drains its queue decide. So the deadline moves by the lateness, the
    time the loop owed the job, at most `timeout_s` in all, and the verdict comes when the timer
    fires on time or the credit is spent. A job is thus judged by its own running time, and a
    hanging one still times out, within twice its timeout plus the loop's stalls.
    """
    if attempt.task.done() or entry.future.done():
      return
    loop = asyncio.get_running_loop()
    late = loop.time() - attempt.timer.when()
    if late > _LATE_S and attempt.credit > 0:
      grace = min(late, attempt.credit)
      attempt.credit -= grace
      attempt.timer = loop.call_later(grace, self._deadline, entry, attempt)
      return
    self._finish(entry, "timeout", None, f"no result within {attempt.timeout_s} s")
    attempt.end()
    attempt.task.cancel()

  def _fault(self, entry: _Entry, value: Any, error: str) -> None:
    """Retries after an infrastructure fault, or gives up when attempts are spent."""
    if entry.attempts >= self.retry.attempts:
      self._finish(entry, INFRA_ERROR, value, error)
      return
    self.retries += 1
    delay = self.retry.delay(entry.attempts, self._rng)
    entry.timer = asyncio.get_running_loop().call_later(delay, self._enqueue, entry)


async def to_thread(fn: Callable[..., Any], /, *args: Any, executor: Any = None, **kwargs: Any) -> Any:
  """Runs blocking `fn(*args, **kwargs)` in a thread; inside a job, its slot stays taken until it returns.

  Like `asyncio.to_thread` (the context is copied into the thread), except that when the
  attempt awaiting it times out or is cancelled, the call goes on (a thread cannot be stopped)
  and keeps the attempt's slot until it has returned; a call whose result nobody awaits any more
  by the time a thread is free for it is not started. `abandoned()`, inside the call, says when
  its result is no longer wanted. When no thread can be started for the call (a passing thread or memory
  limit), that is an infrastructure fault: it raises InfraError, so the scheduler retries the attempt.

  Args:
    fn: the blocking call.
    *args: its positional arguments.
    executor: a concurrent.futures.Executor; None: the loop's default one.
    **kwargs: its keyword arguments.

  Returns:
    What `fn` returns.

  Raises:
    InfraError: no thread could be started for the call.
  """
  loop = asyncio.get_running_loop()
  abandoned = threading.Event()
  context = contextvars.copy_context()
  context.run(_ABANDONED.set, abandoned)

  def call():
    if abandoned.is_set():
      return None  # its attempt is over: do not start work no one will read
    return context.run(fn, *args, **kwargs)

  try:
    future = loop.run_in_executor(executor, call)
  except RuntimeError as e:  # the pool could not start a thread (a thread or memory limit), or is shut down
    # A ThreadPoolExecutor queues the call before it starts a thread: a later thread must not run it.
    abandoned.set()
    raise InfraError(f"no thread for the blocking call: {e}") from e
  return await hold(future, abandoned.set)


async def hold(future: asyncio.Future, abandon: Callable[[], None]) -> Any:
  """Awaits work running outside the loop (a thread, a remote task); inside a job, its slot stays taken until it ends.

  When the attempt awaiting it times out or is cancelled, `abandon` is called (tell the work to stop) and the
  wait ends at once, but the attempt's slot stays taken until `future` is done, so the scheduler's concurrency
  bounds the work really running.

  Args:
    future: the work's future.
    abandon: called when the work's result is no longer wanted (outside a job: once the wait ends).

  Returns:
    The work's result.
  """
  attempt = _ATTEMPT.get()
  if attempt is None:  # not inside a job: there is no slot to hold
    try:
      return await future
    finally:
      abandon()
  attempt.hold(future, abandon)
  try:
    return await asyncio.shield(future)  # a cancellation ends the wait, never the work
  except asyncio.CancelledError:
    abandon()
    raise


def abandoned() -> threading.Event:
  """Inside a call run by `to_thread`: an Event set once nobody awaits its result any more.

  That is when its attempt timed out or was cancelled (or the scheduler closed). The call keeps
  its job's slot until it returns, so a long one may poll this, or wait on it, to stop early.
  Elsewhere: an Event that is never set.
  """
  event = _ABANDONED.get()
  return event if event is not None else threading.Event()


def _stepping(task: asyncio.Task | None) -> bool:
  """Whether `task` is the task running now (its coroutine is being stepped, not closed)."""
  try:
    return task is not None and asyncio.current_task() is task
  except RuntimeError:  # no running loop
    return False
