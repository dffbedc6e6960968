"""ptx.scheduling.offload: blocking calls in the calling thread or as scheduled work; a lost one: InfraError."""

import functools
import pickle
import threading

import pytest

from ptx.scheduling import offload, scheduler
from ptx.envs.shell import ShellEnv
from ptx.scheduling.executors import LocalExecutor

FAST = scheduler.Retry(attempts=3, base_s=0.0, jitter=0.0)


def _add(a: int, b: int) -> int:
  return a + b


def _split(data: bytes) -> tuple[int, bytes]:
  return len(data), data + b"!"


def test_without_an_executor_a_call_runs_in_the_calling_thread_and_raises_as_it_raised():
  calls = offload.Offload()
  assert calls.call(_add, 2, 3) == 5
  assert calls.call(functools.partial(threading.current_thread)) is threading.current_thread()
  assert calls.call(_split, b"ab", keep=True) == (2, b"ab!") and calls.fetch(b"x") == b"x"
  with pytest.raises(ZeroDivisionError):
    calls.call(divmod, 1, 0)


def test_on_an_executor_faults_are_retried_and_what_never_returned_is_an_infra_error():
  calls = offload.Offload(LocalExecutor(), retry=FAST, timeout_s=30)
  tries = []

  def flaky(n: int) -> int:
    tries.append(n)
    if len(tries) < 3:
      raise scheduler.InfraError("node lost")
    return n

  def broken():
    raise ValueError("a bug")

  def lost():
    tries.append("lost")
    raise scheduler.InfraError("node lost")

  try:
    assert calls.call(_split, b"ab", keep=True) == (2, b"ab!")  # the local executor's handle is the value
    assert calls.call(_add, 2, 3) == 5 and calls.call(flaky, 7) == 7 and tries == [7, 7, 7]
    with pytest.raises(scheduler.InfraError, match=r"broken did not return on LocalExecutor after 1 attempt\(s\): "
                                                   r"crashed ValueError\('a bug'\)"):
      calls.call(broken)
    with pytest.raises(scheduler.InfraError, match=r"lost did not return .* after 3 attempt\(s\): infra_error "
                                                   r"InfraError\('node lost'\)"):
      calls.call(lost)
    assert tries == [7, 7, 7, "lost", "lost", "lost"]  # a crash is not retried; a fault is, up to the attempts
  finally:
    calls.close()


def test_a_call_that_outlives_the_timeout_is_an_infra_error():
  calls = offload.Offload(LocalExecutor(), timeout_s=0.2)
  release = threading.Event()
  try:
    with pytest.raises(scheduler.InfraError, match=r"wait did not return .*: timeout no result within 0.2 s"):
      calls.call(release.wait)
  finally:
    release.set()  # the thread it ran on returns, so closing does not wait for it
    calls.close()


@pytest.mark.parametrize("field, value, message", [
    ("concurrency", 0, "ShellEnv.concurrency must be >= 1, got 0"),
    ("job_timeout_s", 0.0, "ShellEnv.job_timeout_s must be > 0 or None, got 0.0"),
])
def test_shell_env_refuses_bad_job_settings_naming_the_field(field, value, message):
  with pytest.raises(ValueError, match=message):
    ShellEnv(**{field: value})


def test_an_environment_with_its_offload_pickles_as_its_settings():
  env = ShellEnv(concurrency=3, job_timeout_s=9.0)
  env._calls.call(_add, 1, 2)  # used: it holds a lock (and would hold a loop thread with an executor)
  again = pickle.loads(pickle.dumps(env))
  assert again == env and again._calls._options == env._calls._options and again._calls is not env._calls
