"""ptx.envs.warm_pool: workspaces prepared ahead are the ones an episode would make; each episode opens its own.

Set-ups here are cheap shell commands; a sandbox run costs tens of milliseconds, so the module takes seconds.
"""

import concurrent.futures
import dataclasses
import hashlib
import os
import tempfile
import time

import pytest

from ptx.sandbox import run as sandbox

from ptx.scheduling import scheduler

from ptx.envs import warm_pool
from ptx.envs.shell import ShellEnv
from ptx.envs.terminal import TerminalTasks, reference_fix

FAST = scheduler.Retry(attempts=3, base_s=0.0, jitter=0.0)
SETUP = "seq 1 500 > data.txt && mkdir -p out && printf '%s\\n' \"$SOURCE_DATE_EPOCH\" > out/epoch"


def _state(i: int, setup: str = SETUP) -> warm_pool.InitialState:
  return warm_pool.InitialState.of({"task.txt": f"task {i}\n", "src/main.py": "print(1)\n"}, setup)


def _settle(pool: warm_pool.WarmPool, held: int) -> None:
  """Waits (generously, for a loaded machine) until nothing is in flight and `held` states are held."""
  deadline = time.monotonic() + 60
  while (pool.in_flight() or pool.held() != held) and time.monotonic() < deadline:
    time.sleep(0.01)
  assert pool.held() == held and pool.in_flight() == 0, (pool.held(), pool.in_flight(), pool.stats)


def test_the_key_names_the_content_and_a_bad_name_is_refused():
  assert _state(0).key == _state(0).key != _state(1).key != _state(1, setup="true").key
  with pytest.raises(ValueError, match="inside the workspace"):
    warm_pool.InitialState.of({"../escape": "x"})


def test_a_pooled_workspace_is_the_one_made_fresh_per_terminal_task_and_seed():
  env = ShellEnv(pool=warm_pool.WarmPool(size=10))
  fresh_env = ShellEnv()
  try:
    records = [TerminalTasks(seed)[i] for seed in (0, 1) for i in range(2)]
    records += [{**records[0], "setup": SETUP}]  # a set-up run in the sandbox, reproducible
    env.expect(records, samples=2)
    _settle(env.pool, 5)
    for record in records:
      pooled, fresh = env.reset(record), fresh_env.reset(record)
      try:
        assert pooled.workspace.snapshot == fresh.workspace.snapshot
        files = pooled.workspace.files()
        assert all(files[name] == text.encode() for name, text in record["files"].items())
        if "setup" in record:
          assert files["data.txt"] == "".join(f"{n}\n" for n in range(1, 501)).encode()
          assert files["out/epoch"] == b"0\n"
      finally:
        pooled.close()
        fresh.close()
    assert env.pool.stats["hits"] == 5 and env.pool.stats["prepared"] == 5  # one preparation per state
    episode = env.reset(records[1])  # its second expected workspace: the episode solves the task in it
    try:
      for command in reference_fix(records[1]):
        episode.step(command)
      assert episode.step("DONE").outcome == "ok"
    finally:
      episode.close()
  finally:
    env.pool.close()


def test_a_workspace_changed_in_the_pool_is_refused():
  with warm_pool.WarmPool(size=2) as pool:
    state = _state(0)
    pool.expect([state] * 3)
    _settle(pool, 1)
    good = pool._held[state.key]
    data = good.snapshot.replace(b"task 0", b"task 9")
    # Bytes changed behind the pool's back, and bytes changed with a digest to match: both are caught.
    for bad in (dataclasses.replace(good, snapshot=data),
                dataclasses.replace(good, snapshot=data, digest=hashlib.sha256(data).hexdigest())):
      pool._held[state.key] = bad
      with pytest.raises(warm_pool.Tampered, match="changed after it was prepared"):
        pool.checkout(state).workspace()
    pool._held[state.key] = good
    assert pool.checkout(state).workspace().snapshot == good.snapshot


def test_a_set_up_that_is_not_reproducible_is_refused_when_verifying():
  with warm_pool.WarmPool(verify=True, retry=FAST) as pool:
    noisy = pool.checkout(warm_pool.InitialState.of({}, "head -c 16 /dev/urandom > noise"))
    with pytest.raises(scheduler.InfraError, match="NotReproducible.*not deterministic"):
      noisy.workspace()
    assert pool.stats["failed"] == 1 and pool.stats["retries"] == 2
    assert pool.checkout(_state(0)).workspace().files()["out/epoch"] == b"0\n"  # deterministic: passes


def test_no_workspace_is_handed_out_twice_under_concurrent_checkouts():
  names = [0, 1, 2, 3, 9]
  states = [_state(i, setup="") for i in names[:4]] + [_state(9)]
  with warm_pool.WarmPool(size=16, concurrency=2) as pool:
    pool.expect(states * 3)  # fewer than the checkouts below: the rest are asked for on demand

    def episode(k):
      workspace = pool.checkout(states[k % len(states)]).workspace()
      assert workspace.files()["task.txt"] == f"task {names[k % len(states)]}\n".encode()
      workspace.write({"mine.txt": str(k)})  # an episode changes its workspace...
      return workspace

    with concurrent.futures.ThreadPoolExecutor(8) as threads:
      workspaces = list(threads.map(episode, range(40)))
    # ...and no other episode sees that: each got a workspace of its own, in its state's initial form.
    assert len({id(w) for w in workspaces}) == 40
    for k, workspace in enumerate(workspaces):
      assert workspace.files()["mine.txt"] == str(k).encode()
    assert pool.stats["handed_out"] == 40 and pool.stats["prepared"] == len(states)
    _settle(pool, len(states))


def test_a_failed_preparation_is_retried_as_an_infrastructure_fault_and_never_scored(monkeypatch):
  calls = {"n": 0}
  real = warm_pool.prepare

  def flaky(state, limits=warm_pool.SETUP_LIMITS):
    calls["n"] += 1
    if calls["n"] <= 2:
      raise scheduler.InfraError("node lost")
    return real(state, limits)

  with monkeypatch.context() as patch:
    patch.setattr(warm_pool, "prepare", flaky)
    with warm_pool.WarmPool(retry=FAST) as pool:
      assert pool.checkout(_state(0)).workspace().files()["task.txt"] == b"task 0\n"
      assert pool.stats["retries"] == 2 and calls["n"] == 3
  # A set-up that always fails: retried, then the episode ends as the infrastructure's error, not the model's.
  env = ShellEnv(pool=warm_pool.WarmPool(retry=FAST))
  try:
    group = [env.reset({"prompt": "p", "files": {}, "setup": "exit 3", "check": "true"}) for _ in range(2)]
    for episode in group:  # both wait on one preparation, and both end with its fault
      step = episode.step("ls")
      assert step.done and step.outcome == "infra_error" and "exit" in step.reason and step.reward == 0.0
      episode.close()
    assert env.pool.stats["retries"] == 2 and env.pool.stats["failed"] == 1
  finally:
    env.pool.close()
  inline = ShellEnv().reset({"prompt": "p", "files": {}, "setup": "exit 3", "check": "true"})
  assert inline.step("ls").outcome == "infra_error"


def test_the_pool_refills_to_its_size_and_stays_within_its_bounds():
  states = [_state(i) for i in range(7)]
  with warm_pool.WarmPool(size=3, concurrency=2) as pool:
    pool.expect(states)
    _settle(pool, 3)  # three of seven prepared ahead, no more
    for i in range(3):
      pool.checkout(states[i]).workspace()
      _settle(pool, 3)  # a state no longer expected makes room for the next expected one
      assert pool.stats["prepared"] == 4 + i and pool.stats["evicted"] == 1 + i
    for i in range(3, 7):
      _settle(pool, 3)
      pool.checkout(states[i]).workspace()
    assert pool.stats["prepared"] == 7 and pool.stats["hits"] == 7
  one = len(warm_pool.prepare(states[0]).snapshot)
  with warm_pool.WarmPool(size=10, max_bytes=2 * one) as pool:
    pool.expect(states)
    _settle(pool, 2)  # the bytes bound stops it first
    assert pool.stats["prepared"] - pool.stats["dropped"] == 2


def test_closing_leaves_nothing_behind():
  before = set(os.listdir(tempfile.gettempdir()))
  pool = warm_pool.WarmPool(size=4)
  state = warm_pool.InitialState.of({"a": "1"}, "sleep 2")
  pool.expect([_state(0), _state(1)])
  waiting = pool.checkout(state)
  pool.close()  # with set-ups still running: close waits for them
  with pytest.raises(scheduler.InfraError, match="closed"):
    waiting.workspace()
  assert pool.held() == 0 and not pool._thread.is_alive()
  assert set(os.listdir(tempfile.gettempdir())) - before == set()
  with pytest.raises(RuntimeError, match="after close"):
    pool.checkout(state)
  assert sandbox.backend()  # the sandbox still works after the pool's threads are gone
