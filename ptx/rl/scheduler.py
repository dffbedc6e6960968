"""Runs many environment instances concurrently: limit, priorities, timeouts, retries.

A job is a zero-argument callable returning an awaitable (called again for each
retry). At most `concurrency` attempts are in flight; the queued job with the
highest priority starts next (ties: first submitted first). Each attempt may
have a timeout. Only infrastructure faults are retried, with exponential
backoff and jitter: an attempt that raises `InfraError`, or returns a value whose
`outcome` is "infra_error". A wrong answer, a crash or a timeout is a result,
never a reason to try again.

Every job ends with a `JobResult` whose outcome is the value's `outcome`
attribute when it has one (a SandboxResult, an environment Step) and "ok"
otherwise; or "timeout", "crashed" (it raised), "infra_error" (retries spent) or
"cancelled". `Scheduler.counts` tallies them. Work that blocks (a sandbox run)
belongs in `asyncio.to_thread` inside the job.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import random
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any

INFRA_ERROR = "infra_error"


class InfraError(Exception):
  """An infrastructure fault (lost worker, full disk): the only failure retried."""


@dataclasses.dataclass(frozen=True)
class Retry:
  """Backoff for infrastructure faults."""

  attempts: int = 3  # tries in all, the first included
  base_s: float = 0.1  # delay before the first retry; doubles each time
  max_s: float = 10.0  # longest delay
  jitter: float = 0.5  # each delay is cut by a random fraction up to this

  def __post_init__(self):
    if self.attempts < 1:
      raise ValueError(f"Retry.attempts must be >= 1, got {self.attempts}")
    if self.base_s < 0 or self.max_s < 0 or not 0 <= self.jitter <= 1:
      raise ValueError(f"Retry.base_s, max_s must be >= 0 and jitter in [0, 1], got {self}")

  def delay(self, attempt: int, rng: random.Random) -> float:
    """Seconds to wait after failed attempt number `attempt` (1-based)."""
    return min(self.max_s, self.base_s * 2 ** (attempt - 1)) * (1 - self.jitter * rng.random())


@dataclasses.dataclass(frozen=True)
class Job:
  """One unit of work for `Scheduler.run`."""

  fn: Callable[[], Awaitable[Any]]  # called once per attempt
  key: Hashable = None  # the caller's name for it, echoed in the result
  priority: int = 0  # higher starts first
  timeout_s: float | None = None  # per attempt; None: the scheduler's default


@dataclasses.dataclass(frozen=True)
class JobResult:
  """How one job ended."""

  key: Hashable
  outcome: str
  value: Any  # what the last attempt returned; None when it raised
  attempts: int
  error: str = ""  # the exception of the last attempt, if any


class _TimedOut(Exception):
  """The attempt's own deadline passed (not a TimeoutError the job raised)."""


@dataclasses.dataclass(eq=False)
class _Entry:
  job: Job
  future: asyncio.Future
  seq: int
  attempts: int = 0
  task: asyncio.Task | None = None  # the attempt in flight
  timer: asyncio.TimerHandle | None = None  # a pending retry


class Scheduler:
  """Runs jobs under a concurrency limit; use as `async with Scheduler(...) as s`.

  Args:
    concurrency: most attempts in flight at once.
    timeout_s: default per-attempt timeout (None: no limit).
    retry: backoff for infrastructure faults.
    seed: seeds the backoff jitter.
  """

  def __init__(self, concurrency: int, *, timeout_s: float | None = None, retry: Retry = Retry(),
               seed: int = 0):
    if concurrency < 1:
      raise ValueError(f"Scheduler.concurrency must be >= 1, got {concurrency}")
    if timeout_s is not None and timeout_s <= 0:
      raise ValueError(f"Scheduler.timeout_s must be > 0 or None, got {timeout_s}")
    self.concurrency, self.timeout_s, self.retry = concurrency, timeout_s, retry
    self.counts: collections.Counter[str] = collections.Counter()
    self.retries = 0  # attempts repeated after an infrastructure fault
    self.in_flight = 0
    self.max_in_flight = 0
    self._rng = random.Random(seed)
    self._seq = itertools.count()
    self._queue: asyncio.PriorityQueue | None = None
    self._workers: list[asyncio.Task] = []
    self._live: set[_Entry] = set()
    self._closed = False

  async def __aenter__(self) -> Scheduler:
    return self

  async def __aexit__(self, *exc) -> None:
    await self.close()

  def submit(self, job: Job) -> asyncio.Future:
    """Queues `job`; returns a future of its JobResult. Cancelling the future cancels the job.

    Args:
      job: the work.

    Returns:
      An asyncio.Future that resolves to the JobResult.
    """
    if self._closed:
      raise RuntimeError("Scheduler.submit after close() or cancel()")
    if job.timeout_s is not None and job.timeout_s <= 0:
      raise ValueError(f"Job.timeout_s must be > 0 or None, got {job.timeout_s} (key {job.key!r})")
    if self._queue is None:
      self._queue = asyncio.PriorityQueue()
      self._workers = [asyncio.create_task(self._work()) for _ in range(self.concurrency)]
    entry = _Entry(job, asyncio.get_running_loop().create_future(), next(self._seq))
    entry.future.add_done_callback(lambda f: self._on_future_done(entry))
    self._live.add(entry)
    self._enqueue(entry)
    return entry.future

  async def run(self, jobs: Iterable[Job]) -> list[JobResult]:
    """Submits `jobs` and waits for all of them.

    Args:
      jobs: the work.

    Returns:
      One JobResult per job, in the order given.
    """
    return list(await asyncio.gather(*[self.submit(job) for job in jobs]))

  def cancel(self) -> None:
    """Ends every unfinished job with outcome "cancelled" and refuses new ones."""
    self._closed = True
    for entry in list(self._live):
      self._finish(entry, "cancelled", None, "cancelled by Scheduler.cancel()")

  async def close(self) -> None:
    """Cancels what is left and stops the workers."""
    self.cancel()
    for worker in self._workers:
      worker.cancel()
    await asyncio.gather(*self._workers, return_exceptions=True)
    self._workers = []

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
      entry.future.set_result(JobResult(entry.job.key, outcome, value, entry.attempts, error))

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
        entry.task = None

  async def _attempt(self, entry: _Entry) -> None:
    entry.attempts += 1
    timeout_s = entry.job.timeout_s if entry.job.timeout_s is not None else self.timeout_s
    entry.task = asyncio.ensure_future(_call(entry.job.fn, timeout_s))
    try:
      value = await entry.task
    except asyncio.CancelledError:
      if asyncio.current_task().cancelling() or not entry.future.done():
        raise  # the worker itself is being stopped
      return  # the job was cancelled; the worker goes on
    except _TimedOut:
      self._finish(entry, "timeout", None, f"no result within {timeout_s} s")
    except InfraError as e:
      self._fault(entry, None, repr(e))
    except Exception as e:  # noqa: BLE001  (a crashing job is a result, not our failure)
      self._finish(entry, "crashed", None, repr(e))
    else:
      outcome = str(getattr(value, "outcome", "ok"))
      if outcome == INFRA_ERROR:
        self._fault(entry, value, "")
      else:
        self._finish(entry, outcome, value)

  def _fault(self, entry: _Entry, value: Any, error: str) -> None:
    """Retries after an infrastructure fault, or gives up when attempts are spent."""
    if entry.attempts >= self.retry.attempts:
      self._finish(entry, INFRA_ERROR, value, error)
      return
    self.retries += 1
    delay = self.retry.delay(entry.attempts, self._rng)
    entry.timer = asyncio.get_running_loop().call_later(delay, self._enqueue, entry)


async def _call(fn: Callable[[], Awaitable[Any]], timeout_s: float | None) -> Any:
  """Awaits one attempt; its own deadline raises _TimedOut, the job's TimeoutError stays one."""
  try:
    async with asyncio.timeout(timeout_s) as deadline:
      return await fn()
  except TimeoutError:
    if deadline.expired():
      raise _TimedOut() from None
    raise
