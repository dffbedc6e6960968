"""Where a scheduled job's attempts run: the executor seam under `ptx.rl.scheduler.Scheduler`.

The scheduler owns every rule about jobs (the concurrency limit, priorities,
timeouts, which failures are retried, the outcome counts); an executor decides
only where an attempt runs. `LocalExecutor`, the default, awaits the job in the
scheduler's own event loop, as the scheduler always has; `ptx.rl.ray_executor`
runs attempts as Ray tasks on a cluster's CPU nodes (the `ray` extra).

An executor's contract: `bind(job)` is called once, when the job is submitted,
and may refuse the job there (naming it); it returns a zero-argument callable
that the scheduler calls once per attempt, in the attempt's task, and awaits.
What the attempt returns is the job's value; an `InfraError` it raises is an
infrastructure fault (retried); anything else it raises is the job's crash.
An attempt calls `job.fn(*job.args)`, each handle among the args resolved to
its value where the attempt runs. A keeping job's `fn` returns `(value,
kept)` and its attempt `(value, handle)`: the local executor's handle is
`kept` itself; Ray's is an object reference, so `kept` stays in the cluster's
object store (on the node that made it, when larger than Ray inlines) and
the next job reads it there. `fetch(handle)` brings a value to the caller.
`Resources` says what one attempt needs where it runs; an executor without a
resource model (the local one) runs every attempt in its own process.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
  from ptx.rl.scheduler import Job

Attempt = Callable[[], Awaitable[Any]]


@dataclasses.dataclass(frozen=True)
class Resources:
  """What one attempt of a job reserves on the node that runs it (Ray's task options)."""

  num_cpus: float = 1.0  # CPU slots held while it runs
  memory_bytes: int | None = None  # memory reserved for it (None: none reserved)
  custom: Mapping[str, float] = dataclasses.field(default_factory=dict)  # e.g. {"sandbox": 1}: a node-declared resource

  def __post_init__(self):
    if self.num_cpus < 0:
      raise ValueError(f"Resources.num_cpus must be >= 0, got {self.num_cpus}")
    if self.memory_bytes is not None and self.memory_bytes <= 0:
      raise ValueError(f"Resources.memory_bytes must be > 0 or None, got {self.memory_bytes}")
    for name, amount in self.custom.items():
      if not isinstance(name, str) or not name or name in ("CPU", "GPU", "memory"):
        raise ValueError(f"Resources.custom: {name!r} is not a custom resource name (use num_cpus, memory_bytes)")
      if amount < 0:
        raise ValueError(f"Resources.custom[{name!r}] must be >= 0, got {amount}")

  @classmethod
  def parse(cls, spec: str) -> Resources:
    """Reads `num_cpus=1,memory_bytes=2e9,sandbox=1` (other names are custom resources).

    Args:
      spec: comma-separated NAME=AMOUNT pairs; empty for the defaults.

    Returns:
      The Resources.

    Raises:
      ValueError: naming the pair that is not NAME=NUMBER.
    """
    fields: dict[str, Any] = {"custom": {}}
    for pair in filter(None, (p.strip() for p in spec.split(","))):
      name, sep, amount = pair.partition("=")
      try:
        value = float(amount)
      except ValueError:
        value = None
      if not sep or not name.strip() or value is None:
        raise ValueError(f"Resources.parse: {pair!r} is not NAME=NUMBER (in {spec!r})")
      name = name.strip()
      if name == "num_cpus":
        fields[name] = value
      elif name == "memory_bytes":
        fields[name] = int(value)
      else:
        fields["custom"][name] = value
    return cls(**fields)


class Executor(Protocol):
  """Runs the attempts of the jobs a scheduler hands it."""

  def bind(self, job: Job) -> Attempt:
    """How the attempts of `job` run here; called once, when it is submitted.

    Args:
      job: the submitted job.

    Returns:
      A zero-argument callable the scheduler calls and awaits once per attempt.

    Raises:
      TypeError: the job cannot run here (the message names its key).
    """

  def fetch(self, handle: Any) -> Any:
    """The value behind `handle` (the kept half of a keeping job's value), here in the caller's process."""


class LocalExecutor:
  """Runs each attempt in the scheduler's own event loop and process (the default)."""

  def bind(self, job: Job) -> Attempt:
    """`job.fn` on `job.args`: each attempt awaits it in the scheduler's loop (a keeping job's kept value is its
    own handle).

    Args:
      job: the submitted job.

    Returns:
      `job.fn`, with `job.args` bound.
    """
    return functools.partial(job.fn, *job.args) if job.args else job.fn

  def fetch(self, handle: Any) -> Any:
    """`handle` itself: here a kept value is its own handle."""
    return handle
