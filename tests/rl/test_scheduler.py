"""ptx.rl.scheduler: exact outcome counts, the concurrency bound, infra-only retries."""

import asyncio
import collections
import dataclasses

import pytest

from ptx.rl import scheduler as sched


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

  def job(self, i: int) -> sched.Job:
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
    return sched.Job(fn, key=(i, kind), timeout_s=0.05 if kind == "hanging" else None)


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
    return sched.Job(fn, key=name, priority=priority)

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
    futures = [s.submit(sched.Job(lambda i=i: hang(i), key=i)) for i in range(50)]
    futures.append(s.submit(sched.Job(infra, key="backing off", priority=1)))
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
      slow = s.submit(sched.Job(slow_job, key="slow"))
      quick = s.submit(sched.Job(quick_job, key="quick"))
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
      return await s.submit(sched.Job(raises))

  assert asyncio.run(main()).outcome == "crashed"


def test_bad_arguments_name_the_field():
  with pytest.raises(ValueError, match="concurrency"):
    sched.Scheduler(0)
  with pytest.raises(ValueError, match="Retry.attempts"):
    sched.Retry(attempts=0)

  async def main():
    async with sched.Scheduler(1) as s:
      s.submit(sched.Job(lambda: asyncio.sleep(0), timeout_s=0, key="k"))

  with pytest.raises(ValueError, match="Job.timeout_s"):
    asyncio.run(main())
