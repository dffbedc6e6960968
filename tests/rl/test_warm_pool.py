"""ptx.rl.warm_pool: workspaces prepared ahead are the ones an episode would make, each handed out once.

Set-ups here are cheap shell commands; a sandbox run costs tens of milliseconds, so the module takes seconds.
"""

import concurrent.futures
import dataclasses
import hashlib
import os
import tempfile
import time

import pytest

from ptx.rl import sandbox, scheduler, warm_pool
from ptx.rl.environments.shell import ShellEnv
from ptx.rl.environments.terminal import TerminalTasks, reference_fix

FAST = scheduler.Retry(attempts=3, base_s=0.0, jitter=0.0)
SETUP = "seq 1 500 > data.txt && mkdir -p out && printf '%s\\n' \"$SOURCE_DATE_EPOCH\" > out/epoch"


def _state(i: int, setup: str = SETUP) -> warm_pool.InitialState:
  return warm_pool.InitialState.of({"task.txt": f"task {i}\n", "src/main.py": "print(1)\n"}, setup)


def _settle(pool: warm_pool.WarmPool, ready: int) -> None:
  """Waits (generously, for a loaded machine) until nothing is in flight and `ready` workspaces are held."""
  deadline = time.monotonic() + 60
  while (pool.in_flight() or pool.ready() != ready) and time.monotonic() < deadline:
    time.sleep(0.01)
  assert pool.ready() == ready and pool.in_flight() == 0, (pool.ready(), pool.in_flight(), pool.stats)


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
    _settle(env.pool, 10)
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
    assert env.pool.stats["hits"] == 5 and env.pool.stats["prepared"] == 10
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
    pool.expect([state, state])
    _settle(pool, 2)
    held = pool._ready[state.key]
    good = held[0]
    data = good.snapshot.replace(b"task 0", b"task 9")
    # Bytes changed behind the pool's back, and bytes changed with a digest to match: both are caught.
    held[0] = dataclasses.replace(good, snapshot=data)
    held[1] = dataclasses.replace(good, snapshot=data, digest=hashlib.sha256(data).hexdigest())
    for _ in range(2):
      lease = pool.checkout(state)
      with pytest.raises(warm_pool.Tampered, match="changed after it was prepared"):
        lease.workspace()
    intact = pool.checkout(state)  # the next one is prepared again, and passes
    assert intact.workspace().snapshot == good.snapshot


def test_a_set_up_that_is_not_reproducible_is_refused():
  with warm_pool.WarmPool(size=1, retry=FAST) as pool:
    state = warm_pool.InitialState.of({}, "head -c 16 /dev/urandom > noise")
    first = pool.checkout(state).workspace()
    with pytest.raises(scheduler.InfraError, match="not reproducible"):
      pool.checkout(state).workspace()
    assert len(first.files()["noise"]) == 16


def test_no_workspace_is_handed_out_twice_under_concurrent_checkouts():
  names = [0, 1, 2, 3, 9]
  states = [_state(i, setup="") for i in names[:4]] + [_state(9)]
  with warm_pool.WarmPool(size=16, concurrency=2) as pool:
    pool.expect(states * 3)  # fewer than the checkouts below: the rest are asked for on demand
    handed = []

    def episode(k):
      lease = pool.checkout(states[k % len(states)])
      workspace = lease.workspace()
      handed.append(lease._wait()[0])  # the pool's own object: no other lease may hold it
      assert workspace.files()["task.txt"] == f"task {names[k % len(states)]}\n".encode()
      workspace.write({"mine.txt": str(k)})  # an episode changes its workspace...
      return workspace

    with concurrent.futures.ThreadPoolExecutor(8) as threads:
      workspaces = list(threads.map(episode, range(40)))
    # ...and no other episode sees that: each got a workspace of its own, in its state's initial form.
    assert len({id(w) for w in workspaces}) == len({id(p) for p in handed}) == 40
    for k, workspace in enumerate(workspaces):
      assert workspace.files()["mine.txt"] == str(k).encode()
    assert pool.stats["handed_out"] == 40 and pool.stats["prepared"] >= 40
    _settle(pool, pool.stats["prepared"] - 40)


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
    episode = env.reset({"prompt": "p", "files": {}, "setup": "exit 3", "check": "true"})
    step = episode.step("ls")
    assert step.done and step.outcome == "infra_error" and "exit" in step.reason and step.reward == 0.0
    assert env.pool.stats["retries"] == 2 and env.pool.stats["failed"] == 1
    episode.close()
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
      _settle(pool, 3)  # each checkout is refilled from what is expected
    assert pool.stats["prepared"] == 6 and pool.stats["hits"] == 3
    for i in range(3, 7):
      pool.checkout(states[i]).workspace()
    _settle(pool, 0)
  one = len(warm_pool.prepare(states[0]).snapshot)
  with warm_pool.WarmPool(size=10, max_bytes=2 * one) as pool:
    pool.expect(states)
    _settle(pool, 2)  # the bytes bound stops it first


def test_closing_leaves_nothing_behind():
  before = set(os.listdir(tempfile.gettempdir()))
  pool = warm_pool.WarmPool(size=4)
  state = warm_pool.InitialState.of({"a": "1"}, "sleep 2")
  pool.expect([_state(0), _state(1)])
  waiting = pool.checkout(state)
  pool.close()  # with set-ups still running: close waits for them
  with pytest.raises(scheduler.InfraError, match="closed"):
    waiting.workspace()
  assert pool.ready() == 0 and not pool._thread.is_alive()
  assert set(os.listdir(tempfile.gettempdir())) - before == set()
  with pytest.raises(RuntimeError, match="after close"):
    pool.checkout(state)
  assert sandbox.backend()  # the sandbox still works after the pool's threads are gone
