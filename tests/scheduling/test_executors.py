"""ptx.scheduling.executors: the seam under the scheduler (bound once per unit of work, called once per attempt)."""

import asyncio
import collections

import pytest

from ptx.scheduling import scheduler as sched
from ptx.scheduling.executors import LocalExecutor
from ptx.scheduling.work import Resources


class CountingExecutor(LocalExecutor):
  """The local executor, counting the jobs bound and the attempts run."""

  def __init__(self):
    self.bound = collections.Counter()
    self.attempts = collections.Counter()

  def bind(self, job):
    self.bound[job.key] += 1
    fn = super().bind(job)

    async def attempt():
      self.attempts[job.key] += 1
      return await fn()
    return attempt


def test_the_executor_binds_each_job_once_and_runs_each_attempt_while_the_scheduler_keeps_the_rules():
  calls = collections.Counter()

  async def flaky():
    calls["flaky"] += 1
    if calls["flaky"] < 3:
      raise sched.InfraError("lost")
    return "fine"

  async def crash():
    raise ValueError("bug")

  executor = CountingExecutor()

  async def main():
    async with sched.Scheduler(2, executor=executor, retry=sched.Retry(attempts=3, base_s=0, max_s=0)) as s:
      return s, await s.run([sched.Work(flaky, key="flaky"), sched.Work(crash, key="crash")])

  s, results = asyncio.run(main())
  assert [(r.outcome, r.attempts, r.value) for r in results] == [("ok", 3, "fine"), ("crashed", 1, None)]
  assert executor.bound == {"flaky": 1, "crash": 1} and executor.attempts == {"flaky": 3, "crash": 1}
  assert dict(s.counts) == {"ok": 1, "crashed": 1} and s.retries == 2


def test_resources_parse_names_custom_resources_and_refuses_bad_pairs():
  assert Resources.parse("") == Resources()
  assert Resources.parse("num_cpus=0.5, memory_bytes=2e9,sandbox=1") == Resources(0.5, 2_000_000_000, {"sandbox": 1})
  with pytest.raises(ValueError, match=r"'sandbox' is not NAME=NUMBER"):
    Resources.parse("num_cpus=1,sandbox")
  with pytest.raises(ValueError, match=r"'num_cpus=many' is not NAME=NUMBER"):
    Resources.parse("num_cpus=many")


@pytest.mark.parametrize("kwargs, field", [({"num_cpus": -1}, "num_cpus"), ({"memory_bytes": 0}, "memory_bytes"),
                                           ({"custom": {"sandbox": -1}}, r"custom\['sandbox'\]"),
                                           ({"custom": {"CPU": 1}}, "custom: 'CPU'")])
def test_resources_refuse_bad_amounts_naming_the_field(kwargs, field):
  with pytest.raises(ValueError, match=rf"Resources.{field}"):
    Resources(**kwargs)
