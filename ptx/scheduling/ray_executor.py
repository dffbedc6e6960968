"""Runs a scheduler's attempts as Ray tasks on a cluster's CPU nodes (the `ray` extra: pip install 'ptx[ray]').

Each attempt of a job is one Ray task holding the job's `Resources` (CPU slots,
memory, custom resources such as "sandbox" that the CPU nodes declare) while it
runs; on its node the job's `fn` is called and what it returns awaited in an
event loop of the task's own. The scheduler keeps every rule: Ray retries
nothing (`max_retries=0`), so an attempt runs once, and the scheduler retries it
when Ray reports a lost worker, node or result (`INFRA_FAULTS`, raised as
`InfraError`). What the job returns, or raises, comes back as it would locally,
so a job ends with the same outcome on either executor.

A job's `args` travel as the Ray task's own arguments, so the object
references among them (what earlier keeping jobs kept) are resolved by Ray on
the node, fetched from the node that holds them. A keeping job's task has two
returns: the value, awaited by the trainer, and the kept part, left in the
object store behind its reference. Ray inlines a return under 100 KiB into the
trainer's memory (it travels, but it is small), and leaves a larger one on the
node that made it: a large workspace snapshot then goes from node to node, not
through the trainer, and is lost with that node (the next job that needs it
fails as an infrastructure fault, `ObjectLostError`).

Jobs travel by pickle (cloudpickle: closures and lambdas pickle, open files,
locks, sockets and processes do not); `bind` pickles a job's `fn` once, at
submit, and refuses one that does not pickle, naming its key. Its modules must
import on the nodes (install ptx there).

When an attempt times out or is cancelled, its task is cancelled by force (its
worker process is killed: a task blocked in a call cannot be interrupted
otherwise), and its slot stays taken until Ray reports the task ended. An
attempt's clock starts when it is handed to Ray, so keep the scheduler's
concurrency within the slots the nodes offer (jobs then wait in the scheduler's
queue, in priority order, not in Ray's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any

import ray
from ray import cloudpickle
from ray import exceptions as ray_errors

from ptx.scheduling import scheduler
from ptx.scheduling.executors import Attempt
from ptx.scheduling.work import Resources

# What Ray raises when the infrastructure lost an attempt (not what the job did): its worker process died, its node
# died or its raylet did, or its result was lost with the node that held it.
INFRA_FAULTS = (ray_errors.WorkerCrashedError, ray_errors.NodeDiedError, ray_errors.LocalRayletDiedError,
                ray_errors.ObjectLostError)


@dataclasses.dataclass(frozen=True)
class _Raised:
  """What a job raised on its node, carried back as a value so that Ray does not wrap it."""

  error: BaseException


def _attempt_on_node(payload: bytes, keeps: bool, *args: Any) -> Any:
  """The Ray task: one attempt of the pickled job on `args`, run to its end in an event loop of its own.

  A keeping job's task returns two objects, (value, kept); one that raised returns (_Raised, None).
  """
  fn = cloudpickle.loads(payload)

  async def attempt():
    return await fn(*args)

  try:
    return asyncio.run(attempt())
  except BaseException as e:  # noqa: BLE001  (SystemExit included: locally it is the job's crash, so here too)
    return (_Raised(e), None) if keeps else _Raised(e)


class RayExecutor:
  """Runs each attempt as a Ray task holding the job's resources.

  Args:
    address: the Ray cluster to join ("auto" on a machine that joined it with `ray start`, or "HOST:6379");
      None: the cluster this process is connected to already, else RAY_ADDRESS, else a new local one. Joined at
      the first job.
    resources: what an attempt reserves when its job names none.
  """

  def __init__(self, address: str | None = None, resources: Resources = Resources()):
    self.address, self.resources = address, resources
    self._remote = None

  def bind(self, job: scheduler.Work) -> Attempt:
    """Pickles `job.fn` once and returns its attempt: a Ray task per call.

    Args:
      job: the submitted job.

    Returns:
      A zero-argument async callable that runs one attempt on the cluster.

    Raises:
      TypeError: `job.fn` does not pickle (the message names the job's key and the reason).
    """
    try:
      payload = cloudpickle.dumps(job.fn)
    except Exception as e:  # noqa: BLE001  (pickling fails with many types: TypeError, PicklingError, ...)
      raise TypeError(f"Work {job.key!r} cannot run on Ray: its fn does not pickle ({e!r}); a job for Ray must "
                      "pickle (no open files, locks, sockets or processes in what it captures)") from e
    resources = job.resources if job.resources is not None else self.resources
    return functools.partial(self._attempt, payload, _options(resources), job.keeps, job.args)

  def fetch(self, handle: Any) -> Any:
    """The value behind `handle`: an object reference's, fetched from the cluster (anything else is its own)."""
    return ray.get(handle) if isinstance(handle, ray.ObjectRef) else handle

  async def _attempt(self, payload: bytes, options: dict[str, Any], keeps: bool, args: tuple) -> Any:
    """One attempt: a Ray task of the pickled job; Ray's losses raised as InfraError, the job's own as it raised."""
    refs = self._task().options(num_returns=2 if keeps else 1, **options).remote(payload, keeps, *args)
    ref = refs[0] if keeps else refs
    try:
      value = await scheduler.hold(asyncio.wrap_future(ref.future()), functools.partial(ray.cancel, ref, force=True))
    except INFRA_FAULTS as e:  # a lost worker or node, or an argument lost with the node that held it
      raise scheduler.InfraError(f"Ray lost the attempt: {e!r}") from e
    if isinstance(value, _Raised):
      raise value.error
    return (value, refs[1]) if keeps else value

  def _task(self) -> Any:
    """The Ray remote function, made once this process has joined the cluster."""
    if self._remote is None:
      if not ray.is_initialized():
        # The workers' output is the jobs' (environments, sandboxed programs): not for the trainer's log.
        ray.init(address=self.address, log_to_driver=False)
      # max_retries=0: the scheduler alone decides what is retried, so each attempt runs once and is counted once.
      self._remote = ray.remote(max_retries=0, retry_exceptions=False)(_attempt_on_node)
    return self._remote


def _options(resources: Resources) -> dict[str, Any]:
  """Ray's task options for `resources`."""
  options: dict[str, Any] = {"num_cpus": resources.num_cpus, "resources": dict(resources.custom)}
  if resources.memory_bytes is not None:
    options["memory"] = resources.memory_bytes
  return options
