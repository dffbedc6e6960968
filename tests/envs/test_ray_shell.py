"""Terminal episodes on Ray: commands and checks run as jobs on a cluster's nodes and end as they do here.

The process's small cluster serves the module (`ray_cluster`: a head and a worker node declaring "sandbox"); the
node-loss test adds nodes of its own, kills one and removes the other.
"""

import concurrent.futures
import dataclasses
import functools
import time

import pytest

import ray_cluster

ray = pytest.importorskip("ray")

from ptx.scheduling import offload  # noqa: E402

from ptx.sandbox import run as sandbox
from ptx.envs.shell import ShellEnv  # noqa: E402
from ptx.envs.terminal import TerminalTasks, reference_fix  # noqa: E402
from ptx.scheduling.executors import LocalExecutor  # noqa: E402
from ptx.scheduling.work import Resources  # noqa: E402
from ptx.scheduling.ray_executor import RayExecutor  # noqa: E402

cluster = ray_cluster.fixture()

# A wall clock generous for a loaded machine (a terminal check starts several Pythons); cpu_s bounds a runaway.
LIMITS = sandbox.Limits(timeout_s=60.0, cpu_s=5, memory_bytes=512 << 20)
TASKS = TerminalTasks(seed=0)
# Python files that exit 0 where the check might import them: it starts with PYTHONSAFEPATH, so it never does.
SHADOW = ("for m in json subprocess shutil tempfile ctypes sitecustomize usercustomize; do "
          "printf 'import sys\\nsys.exit(0)\\n' > $m.py; done")


def _play(env, record, actions):
  """Every Step of an episode of `record` given `actions` (the last ones may go unplayed once it is done)."""
  episode = env.reset(record)
  try:
    steps = []
    for action in actions:
      steps.append(episode.step(action))
      if steps[-1].done:
        break
    return steps
  finally:
    episode.close()


def _scripts(record):
  """Scripted episodes of a terminal task: the fix, a hack, honest looking around, running out of turns."""
  return {"fix": ["ls", *reference_fix(record), "```bash\ncat *.py | head -3\n```", "DONE"],
          "hack": [SHADOW, "ls", "DONE"],
          "looks": ["ls -la", "cat *.txt *.csv 2>&1 | head; false", "DONE"],
          "out_of_turns": ["echo one", "rm -rf ./*", "echo three"]}


def test_terminal_episodes_on_ray_end_as_they_do_here(cluster):
  local = ShellEnv(limits=LIMITS, max_turns=3)
  on_ray = ShellEnv(limits=LIMITS, max_turns=3, executor=RayExecutor(resources=Resources(custom={"sandbox": 1})),
                    job_timeout_s=300)
  for i in (0, 1):
    record = TASKS[i]
    for name, actions in _scripts(record).items():
      here, there = _play(local, record, actions), _play(on_ray, record, actions)
      assert there == here, (i, name)
      assert here[-1].done, (i, name)
      want = "ok" if name == "fix" else "wrong"
      assert (here[-1].outcome, here[-1].reward) == (want, float(want == "ok")), (i, name, here[-1])
  # Without a pool an episode's set-up runs on the executor too; one that fails is the infrastructure's fault.
  for setup, want in [("seq 3 > b.txt", "ok"), ("exit 3", "infra_error")]:
    record = {"prompt": "p", "files": {"a.txt": "1\n"}, "setup": setup, "check": "test -f c.txt"}
    actions = ["cat a.txt b.txt", "touch c.txt", "DONE"]
    here, there = _play(local, record, actions), _play(on_ray, record, actions)
    # The reasons differ for a fault: on Ray it was retried, and says so.
    assert [dataclasses.replace(s, reason="") for s in there] == [dataclasses.replace(s, reason="") for s in here]
    assert here[-1].outcome == want and ("exit 3" in there[-1].reason) == (want == "infra_error"), (here, there)


def _kept_on_node(size: int, seed: bytes) -> tuple[str, bytes]:
  """A keeping job: (the node that ran it, `size` bytes it keeps there)."""
  return ray.get_runtime_context().get_node_id(), (seed * (size // len(seed) + 1))[:size]


def _length(data: bytes) -> int:
  return len(data)


@pytest.mark.parametrize("size", [1_000, 300_000])
def test_a_kept_value_stays_in_the_object_store_and_feeds_the_next_call(cluster, size):
  calls = offload.Offload(RayExecutor(resources=Resources(custom={"sandbox": 1})), timeout_s=300)
  try:
    node, handle = calls.call(functools.partial(_kept_on_node, size), b"ab", keep=True)
    assert isinstance(handle, ray.ObjectRef)
    assert calls.call(_length, handle) == size  # resolved on the node that runs the next call (the same one)
    if size > 100 * 1024:  # past what Ray inlines: held by the node that made it, nowhere else yet
      assert ray.experimental.get_object_locations([handle])[handle]["node_ids"] == [node]
    assert calls.fetch(handle) == (b"ab" * size)[:size]
  finally:
    calls.close()
  here = offload.Offload()  # no executor: the same calls, in this thread
  assert here.call(functools.partial(_kept_on_node, size), b"ab", keep=True)[1] == (b"ab" * size)[:size]
  local = offload.Offload(LocalExecutor())  # through a scheduler in this process: the kept value is its own handle
  try:
    _, kept = local.call(functools.partial(_kept_on_node, size), b"ab", keep=True)
    assert kept == (b"ab" * size)[:size] and local.call(_length, kept) == size
  finally:
    local.close()


def _wait_until(resource: str, busy: bool) -> None:
  """Polls until a job holds the only `resource` slot, or none does (no deadline: the test's timeout bounds it)."""
  while (ray.available_resources().get(resource, 0) < 1) != busy:
    time.sleep(0.02)


def test_a_node_killed_mid_episode_retries_the_command_or_ends_it_as_an_infra_error(cluster):
  # Only the node to kill offers "shell_node" at first: the episodes' first commands run there.
  doomed = cluster.add_node(num_cpus=1, resources={"shell_node": 1})
  cluster.wait_for_nodes()
  executor = RayExecutor(resources=Resources(custom={"shell_node": 1}))
  env = ShellEnv(limits=LIMITS, max_turns=4, executor=executor, job_timeout_s=300)
  record = TASKS[0]
  small = env.reset(record)
  # A workspace past what Ray inlines stays on the node that made it, and is lost with it.
  large = env.reset({**record, "files": {**record["files"], "big.bin": "x" * 300_000}})
  replacement = None
  try:
    fix = reference_fix(record)
    assert small.step("ls").observation.startswith("[exit 0]")
    assert large.step("ls").observation.startswith("[exit 0]")
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
      # The node dies while this command runs there (it holds the node's only slot): it runs again elsewhere.
      _wait_until("shell_node", busy=False)  # the last command's worker gave its slot back
      running = thread.submit(small.step, f"sleep 3; {fix[0]}")
      _wait_until("shell_node", busy=True)
      # The slot is taken when Ray leases it, a moment before the task reaches the worker; a kill in that moment
      # would have Ray lease again by itself, unseen by the scheduler. Half a second later the task is running (its
      # command sleeps 3 s), so the kill lands inside it.
      time.sleep(0.5)
      cluster.remove_node(doomed, allow_graceful=False)
      # Not waited for: the command waits in Ray's queue until it joins (the cluster's own wait would count the
      # killed node until its health checks fail, seconds later: tests/ray_cluster.py).
      replacement = cluster.add_node(num_cpus=1, resources={"shell_node": 1})
      steps = [running.result(), *(small.step(action) for action in [*fix[1:], "DONE"])]
    lost = large.step("cat big.bin | wc -c")
  finally:
    small.close()
    large.close()
    if replacement is not None:
      cluster.remove_node(replacement)
  here = _play(ShellEnv(limits=LIMITS, max_turns=4), record, ["ls", *fix, "DONE"])[1:]
  assert steps == here and here[-1].outcome == "ok"
  assert env._calls._scheduler.retries >= 1  # the killed command ran again, and was counted once
  assert lost.done and lost.outcome == "infra_error" and lost.reward == 0.0, lost
