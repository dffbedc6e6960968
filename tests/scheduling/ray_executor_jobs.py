"""The jobs tests/scheduling/test_ray_executor.py runs on Ray's nodes, in a module of their own that imports no ptx.

A Ray worker imports the module of each job function it runs, and every worker a test starts or kills is a new
process: this module costs it milliseconds, the test module (ptx, JAX) seconds of CPU. The mixed workload's jobs
import ptx only in the kinds that raise its InfraError, which run before any of the kills.
"""

import asyncio
import dataclasses
import os

import ray

# Per 1,000 jobs: the kinds' counts (the rest are "ok"), and the jobs of rare kinds among all of them.
PER_1000 = {"wrong": 100, "crashing": 50, "flaky": 20, "flaky_result": 10, "dead": 5, "slow": 100}
HANGING = {321, 385, 998}  # time out: on Ray each costs a killed worker, so there are few
WORKER_KILLERS = {501, 555}  # on a node they kill their Ray worker at the first attempt; here they raise InfraError


@dataclasses.dataclass(frozen=True)
class Answer:
  """What a job returns: its outcome."""

  outcome: str


def attempt_number(root: str, i: int) -> int:
  """This attempt's number for job `i` (1-based), from the files earlier attempts left in `root`."""
  n = 1
  while True:
    try:
      os.close(os.open(os.path.join(root, f"{i}.{n}"), os.O_CREAT | os.O_EXCL))
      return n
    except FileExistsError:
      n += 1


def kind(i: int) -> str:
  """The kind of job `i` of the mixed workload."""
  if i in HANGING:
    return "hanging"
  if i in WORKER_KILLERS:
    return "worker_killer"
  r, start = i % 1000, 0
  for name, count in PER_1000.items():
    if start <= r < start + count:
      return name
    start += count
  return "ok"


def _infra_error(message: str) -> Exception:
  """The scheduler's InfraError, imported only by the jobs that raise it (see the module's docstring)."""
  from ptx.scheduling.scheduler import InfraError

  return InfraError(message)


async def mixed(i: int, kind: str, root: str, driver_pid: int):
  """Job `i` of the mixed workload; the same on either executor (attempts counted in files under `root`)."""
  if kind in ("flaky", "flaky_result", "dead", "worker_killer"):
    attempt = attempt_number(root, i)
  if kind == "slow":
    await asyncio.sleep(0.002)
  elif kind == "hanging":
    await asyncio.Event().wait()
  elif kind == "crashing":
    raise ValueError(f"bug in instance {i}")
  elif kind == "flaky" and attempt < 3:
    raise _infra_error("worker lost")
  elif kind == "flaky_result" and attempt < 2:
    return Answer("infra_error")
  elif kind == "dead":
    raise _infra_error("disk full")
  elif kind == "worker_killer" and attempt < 2:
    if os.getpid() != driver_pid:
      os._exit(1)  # the Ray worker dies: WorkerCrashedError, an infrastructure fault
    raise _infra_error("worker lost")
  return Answer("wrong" if kind == "wrong" else "ok")


async def blocks_on_doomed_node(i: int, root: str, doomed_node: str):
  """Job `i`: on the node the test kills it blocks; elsewhere it waits for the kill, marks itself done (once
  ever: a second run raises, a crash) and returns."""
  attempt_number(root, i)
  if ray.get_runtime_context().get_node_id() == doomed_node:
    os.close(os.open(os.path.join(root, f"doomed.{i}"), os.O_CREAT))
    await asyncio.Event().wait()  # until the node dies under it
  while not os.path.exists(os.path.join(root, "killed")):
    await asyncio.sleep(0.01)
  os.close(os.open(os.path.join(root, f"done.{i}"), os.O_CREAT | os.O_EXCL))
  return Answer("ok")


async def ran(name: str):
  """A job that returns its name."""
  return name
