"""ptx.scheduling.scheduler: exact outcome counts, the concurrency bound, infra-only retries."""

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time

import pytest

from ptx.scheduling import scheduler as sched
from running_calls import Running


@dataclasses.dataclass(frozen=True)
class Answer:
  outcome: str


class Workload:
  """Simulated environment instances; records attempts and concurrency itself."""

  KINDS = ("fast", "slow", "wrong", "hanging", "crashing", "flaky", "flaky_result", "dead")

  def __init__(self):
    self.attempts = collections.Counter()
    self.in_flight = 0
    self.max_in_flight = 0

  def job(self, i: int) -> sched.Work:
    kind = self.KINDS[i % len(self.KINDS)]

    async def fn():
      self.attempts[i] += 1
      self.in_flight += 1
      self.max_in_flight = max(self.max_in_flight, self.in_flight)
      try:
        await asyncio.sleep(0)
        if kind == "slow":
          await asyncio.sleep(0.01)
        elif kind == "hanging":
          await asyncio.Event().wait()
        elif kind == "crashing":
          raise ValueError(f"bug in instance {i}")
        elif kind == "flaky" and self.attempts[i] < 3:
          raise sched.InfraError("worker lost")
        elif kind == "flaky_result" and self.attempts[i] < 2:
          return Answer("infra_error")
        elif kind == "dead":
          raise sched.InfraError("disk full")
        return Answer("wrong") if kind == "wrong" else Answer("ok")
      finally:
        self.in_flight -= 1

    # Only the hanging kind has a short deadline, so a slow machine cannot time out the rest.
    return sched.Work(fn, key=(i, kind), timeout_s=0.05 if kind == "hanging" else None)


def test_ten_thousand_mixed_instances_end_with_exact_counts():
  work = Workload()
  n, limit = 10_000, 200
  retry = sched.Retry(attempts=3, base_s=0.005, max_s=0.02)

  async def main():
    async with sched.Scheduler(limit, timeout_s=60, retry=retry) as s:
      results = await s.run(work.job(i) for i in range(n))
    return s, results

  s, results = asyncio.run(main())
  per_kind = n // len(Workload.KINDS)
  expected = {"ok": 4 * per_kind, "wrong": per_kind, "timeout": per_kind, "crashed": per_kind,
              "infra_error": per_kind}
  assert dict(s.counts) == expected
  assert collections.Counter(r.outcome for r in results) == collections.Counter(expected)
  assert [r.key[0] for r in results] == list(range(n))
  assert work.max_in_flight == s.max_in_flight == limit
  tries = {"flaky": 3, "flaky_result": 2, "dead": 3}
  for r in results:
    assert work.attempts[r.key[0]] == r.attempts == tries.get(r.key[1], 1), r
  assert s.retries == per_kind * (2 + 1 + 2)
  assert all("ValueError" in r.error for r in results if r.outcome == "crashed")


def test_higher_priority_starts_first_and_ties_keep_submission_order():
  order = []

  def job(name, priority):
    async def fn():
      order.append(name)
    return sched.Work(fn, key=name, priority=priority)

  async def main():
    async with sched.Scheduler(1) as s:
      await s.run([job("low", -1), job("a", 0), job("high", 5), job("b", 0), job("top", 9)])

  asyncio.run(main())
  assert order == ["top", "high", "a", "b", "low"]


def test_cancel_ends_running_queued_and_backing_off_jobs():
  started, cancelled = [], []

  async def main():
    ten_started = asyncio.Event()

    async def hang(i):
      started.append(i)
      if len(started) == 10:
        ten_started.set()
      try:
        await asyncio.Event().wait()
      except asyncio.CancelledError:
        cancelled.append(i)
        raise

    async def infra():
      raise sched.InfraError("down")

    # The retry is an hour away (max_s caps the delay), so it cannot come before cancel() however slow the machine.
    s = sched.Scheduler(10, retry=sched.Retry(attempts=5, base_s=3600, max_s=3600))
    futures = [s.submit(sched.Work(lambda i=i: hang(i), key=i)) for i in range(50)]
    futures.append(s.submit(sched.Work(infra, key="backing off", priority=1)))
    await ten_started.wait()  # 9 beside the infra job, then one in its place
    s.cancel()
    results = await asyncio.gather(*futures)
    await s.close()
    return s, results

  s, results = asyncio.run(main())
  assert {r.outcome for r in results} == {"cancelled"} and s.counts == {"cancelled": 51}
  assert sorted(cancelled) == sorted(started) and len(started) == 10
  assert results[-1].attempts == 1 and s.retries == 1


def test_cancelling_one_future_cancels_that_job_only():
  async def main():
    slow_started, quick_started, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow_job():
      slow_started.set()
      await asyncio.Event().wait()  # never ends by itself

    async def quick_job():
      quick_started.set()
      await release.wait()
      return Answer("ok")

    async with sched.Scheduler(2) as s:
      slow = s.submit(sched.Work(slow_job, key="slow"))
      quick = s.submit(sched.Work(quick_job, key="quick"))
      await slow_started.wait()
      await quick_started.wait()  # both running: the cancel must reach only one of them
      slow.cancel()
      release.set()
      done = await quick
      return s, done

  s, done = asyncio.run(main())
  assert done.outcome == "ok" and s.counts == {"cancelled": 1, "ok": 1}


def test_a_timeout_error_raised_by_the_job_is_a_crash_not_a_timeout():
  async def raises():
    raise TimeoutError("the job's own")

  async def main():
    async with sched.Scheduler(1, timeout_s=10) as s:
      return await s.submit(sched.Work(raises))

  assert asyncio.run(main()).outcome == "crashed"


def test_bad_arguments_name_the_field():
  with pytest.raises(ValueError, match="concurrency"):
    sched.Scheduler(0)
  with pytest.raises(ValueError, match="Retry.attempts"):
    sched.Retry(attempts=0)

  async def main():
    async with sched.Scheduler(1) as s:
      s.submit(sched.Work(lambda: asyncio.sleep(0), timeout_s=0, key="k"))

  with pytest.raises(ValueError, match="Work.timeout_s"):
    asyncio.run(main())


# Only a hang reaches this (a pass takes milliseconds): it turns a regression into a failure.
HANG_S = 30


async def _turns(n: int) -> None:
  """Lets the loop run `n` rounds: an ordering in loop steps, not in time."""
  for _ in range(n):
    await asyncio.sleep(0)


def test_a_cancelled_error_the_job_raises_itself_is_a_crash_and_frees_its_slot():
  async def raises():
    raise asyncio.CancelledError()

  async def cancels_itself():
    asyncio.current_task().cancel()
    await asyncio.sleep(0)

  async def fine():
    return Answer("ok")

  async def main():
    # Two workers, five jobs that end in a CancelledError nobody asked for: if one killed its
    # worker or kept its slot, the last job would never run and run() would hang.
    async with sched.Scheduler(2) as s:
      jobs = [sched.Work(raises, key=i) for i in range(4)]
      jobs += [sched.Work(cancels_itself, key="self"), sched.Work(fine, key="fine")]
      results = await asyncio.wait_for(s.run(jobs), HANG_S)
      assert s.in_flight == 0
    return s, results

  s, results = asyncio.run(main())
  assert [r.outcome for r in results] == ["crashed"] * 5 + ["ok"]
  assert all("CancelledError" in r.error for r in results[:5])
  assert s.counts == {"crashed": 5, "ok": 1} and [r.attempts for r in results] == [1] * 6


def test_system_exit_generator_exit_and_keyboard_interrupt_from_a_job_are_crashes():
  def raising(exc):
    async def fn():
      raise exc
    return fn

  def raising_in_a_thread(exc):
    def call():
      raise exc
    return lambda: sched.to_thread(call)

  async def fine():
    return Answer("ok")

  excs = [SystemExit(3), GeneratorExit(), KeyboardInterrupt()]

  async def main():
    async with sched.Scheduler(1) as s:  # one worker: it has to survive every one of them
      jobs = [sched.Work(raising(e), key=type(e).__name__) for e in excs]
      jobs += [sched.Work(raising_in_a_thread(e), key=type(e).__name__) for e in excs]
      jobs.append(sched.Work(fine, key="fine"))
      results = await asyncio.wait_for(s.run(jobs), HANG_S)
    return s, results

  s, results = asyncio.run(main())
  assert [r.outcome for r in results] == ["crashed"] * 6 + ["ok"]
  for r in results[:6]:
    assert r.error.startswith(r.key + "("), r
  assert s.counts == {"crashed": 6, "ok": 1}


def test_a_real_cancellation_stays_a_cancellation_and_frees_its_slot():
  async def main():
    started = asyncio.Event()

    async def stubborn():
      started.set()
      try:
        await asyncio.Event().wait()
      except asyncio.CancelledError:
        raise asyncio.CancelledError("cleaning up") from None  # a fresh one: still the cancellation

    async def fine():
      return Answer("ok")

    async with sched.Scheduler(1) as s:
      by_caller = s.submit(sched.Work(stubborn, key="caller"))
      after = s.submit(sched.Work(fine, key="after"))
      await started.wait()
      by_caller.cancel()
      assert (await asyncio.wait_for(after, HANG_S)).outcome == "ok"  # the slot came back
      # Its deadline cancels it; what it raises then is the timeout's doing, not a crash.
      # 0.01 s: the job never ends by itself, so the value only sets how soon the test goes on.
      timed = await s.submit(sched.Work(stubborn, key="deadline", timeout_s=0.01))
      started.clear()
      by_close = s.submit(sched.Work(stubborn, key="close"))
      await started.wait()
    return s, by_caller, timed, by_close.result()  # __aexit__ ran close() while it was running

  s, by_caller, timed, by_close = asyncio.run(main())
  assert by_caller.cancelled() and timed.outcome == "timeout" and by_close.outcome == "cancelled"
  assert s.counts == {"cancelled": 2, "ok": 1, "timeout": 1} and s.in_flight == 0


def _hold_loop_until(event: threading.Event) -> None:
  """Called on the loop right after a job hands its call to a thread: blocks the loop until the
  call is running, so no deadline or cancellation can reach the attempt before it starts (HANG_S
  bounds it should the call never start)."""
  asyncio.get_running_loop().call_soon(event.wait, HANG_S)


def test_a_timed_out_or_cancelled_blocking_call_keeps_its_slot_until_it_returns():
  limit = 2
  running, let_go = Running(), threading.Event()
  started = {"timed out": threading.Event(), "cancelled": threading.Event()}
  quick_started = []

  def stuck(key):
    with running:
      started[key].set()
      let_go.wait()

  def quick():
    with running:
      pass

  async def main():
    ended = asyncio.Semaphore(0)

    def stuck_job(key):
      async def fn():
        _hold_loop_until(started[key])
        try:
          return await sched.to_thread(stuck, key)
        finally:
          ended.release()
      return fn

    async def quick_job(i):
      quick_started.append(i)
      return await sched.to_thread(quick)

    try:
      async with sched.Scheduler(limit) as s:
        # 0.01 s: the call never returns before let_go, so the value only sets how soon it times out.
        timed = s.submit(sched.Work(stuck_job("timed out"), key="timed out", timeout_s=0.01))
        dropped = s.submit(sched.Work(stuck_job("cancelled"), key="cancelled"))
        rest = [s.submit(sched.Work(lambda i=i: quick_job(i), key=i)) for i in range(3)]
        assert (await timed).outcome == "timeout"  # reported at once, its thread still running
        dropped.cancel()
        await ended.acquire()
        await ended.acquire()  # both attempts are over; a freed slot would start a quick job within 3 rounds
        await _turns(20)
        assert quick_started == [] and s.in_flight == limit and running.now == limit
        let_go.set()
        results = await asyncio.wait_for(asyncio.gather(*rest), HANG_S)
    finally:
      let_go.set()  # a failed assertion must not leave threads that the scheduler's close() waits for
    return s, results

  s, results = asyncio.run(main())
  assert [r.outcome for r in results] == ["ok"] * 3 and quick_started == [0, 1, 2]
  assert running.peak == limit and running.now == 0
  assert s.counts == {"timeout": 1, "cancelled": 1, "ok": 3} and s.max_in_flight == limit


def test_a_blocking_call_learns_that_its_attempt_is_over():
  seen = []
  started = threading.Event()

  def waits_for_its_end():
    started.set()
    seen.append(sched.abandoned().wait(HANG_S))

  async def main():
    async def job():
      _hold_loop_until(started)
      return await sched.to_thread(waits_for_its_end)

    async with sched.Scheduler(1) as s:
      # 0.01 s: the call ends only once abandoned, so the value only sets the test's length.
      first = s.submit(sched.Work(job, key="first", timeout_s=0.01))
      after = s.submit(sched.Work(lambda: sched.to_thread(lambda: seen.append("after")), key="after"))
      return await asyncio.wait_for(asyncio.gather(first, after), HANG_S)

  first, after = asyncio.run(main())
  assert first.outcome == "timeout" and after.outcome == "ok"
  assert seen == [True, "after"]  # the next call started only after the abandoned one returned
  assert not sched.abandoned().is_set()  # outside a call: never set


def test_a_timeout_counts_from_the_attempts_start_not_from_its_submission():
  started, let_go = threading.Event(), threading.Event()

  async def main():
    async def holds_the_slot():
      _hold_loop_until(started)
      return await sched.to_thread(lambda: (started.set(), let_go.wait()))

    async def quick():
      await asyncio.sleep(0)  # one round of the loop: runnable work goes before expired timers
      return Answer("ok")

    try:
      async with sched.Scheduler(1) as s:
        # 0.01 s for both: the first never ends before let_go, and `quick` needs one loop round,
        # which no deadline can interrupt. Only a clock started at submission could expire it.
        first = s.submit(sched.Work(holds_the_slot, key="first", timeout_s=0.01))
        queued = s.submit(sched.Work(quick, key="queued", timeout_s=0.01))
        assert (await first).outcome == "timeout"
        await asyncio.sleep(0.05)  # not ordering: the queued job has now waited longer than its timeout
        assert not queued.done()  # the first call still holds the only slot
        let_go.set()
        return await asyncio.wait_for(queued, HANG_S)
    finally:
      let_go.set()  # a failed assertion must not leave threads that the scheduler's close() waits for

  assert asyncio.run(main()).outcome == "ok"


# The stalls below block the loop this long past an attempt's deadline: well above _LATE_S (what an
# unhindered loop may be late), like the 150 ms stall seen under stress. The deadlines (0.2 s) never
# decide by themselves: each stall starts before its deadline and outlasts it.
STALL_PAST_S = 0.15


def _stall(until: float, first: threading.Thread | None = None) -> None:
  """A synchronous loop callback that blocks it (as a slow callback or the GIL held elsewhere would)."""
  if first is not None:
    first.join()
  while time.monotonic() < until:  # loop.time() is time.monotonic()
    time.sleep(0.01)


def test_a_loop_stall_across_the_deadline_does_not_time_out_a_job_that_finished_in_time():
  timeout_s = 0.2

  async def main():
    loop = asyncio.get_running_loop()

    async def job():
      start = loop.time()  # no earlier than the attempt's start, so start + timeout_s >= its deadline
      result, stalling = loop.create_future(), threading.Event()

      def work():  # the job's own work: done, and its result posted, while the loop is blocked
        stalling.wait()
        loop.call_soon_threadsafe(result.set_result, Answer("ok"))

      worker = threading.Thread(target=work)
      worker.start()
      loop.call_soon(stalling.set)
      loop.call_soon(_stall, start + timeout_s + STALL_PAST_S, worker)  # joins it: the result is queued
      return await result

    async with sched.Scheduler(1) as s:
      return await asyncio.wait_for(s.submit(sched.Work(job, timeout_s=timeout_s)), HANG_S)

  assert asyncio.run(main()).outcome == "ok"


def test_a_hanging_job_still_times_out_when_the_loop_stalls_across_its_deadline():
  timeout_s = 0.2

  async def main():
    loop = asyncio.get_running_loop()

    async def hangs():
      loop.call_soon(_stall, loop.time() + timeout_s + STALL_PAST_S)
      await asyncio.Event().wait()

    async with sched.Scheduler(1) as s:
      return await asyncio.wait_for(s.submit(sched.Work(hangs, timeout_s=timeout_s)), HANG_S)

  result = asyncio.run(main())
  assert result.outcome == "timeout" and "0.2 s" in result.error


class _FirstThreadFails(concurrent.futures.ThreadPoolExecutor):
  """A pool whose first submit fails to start a thread, as a thread limit makes it: the call stays queued for the
  thread a later submit starts."""

  def __init__(self):
    super().__init__(2)
    self.stranded = None

  def submit(self, fn, /, *args, **kwargs):
    if self.stranded is None:
      self.stranded = functools.partial(fn, *args, **kwargs)
      raise RuntimeError("can't start new thread")
    super().submit(self.stranded)  # queued first, so it runs first
    return super().submit(fn, *args, **kwargs)


def test_a_call_no_thread_could_start_for_is_retried_and_runs_once():
  calls = []

  async def main():
    with _FirstThreadFails() as pool:
      async with sched.Scheduler(1, retry=sched.Retry(base_s=0.0)) as s:
        return await s.submit(sched.Work(lambda: sched.to_thread(calls.append, "ran", executor=pool), key="k"))

  result = asyncio.run(main())
  assert (result.outcome, result.attempts, result.error) == ("ok", 2, "")
  assert calls == ["ran"]  # the call the failed submit had queued was dropped, not run a second time
