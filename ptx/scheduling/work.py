"""What the scheduler runs and how it ended: the vocabulary `ptx.scheduling.scheduler` and its executors speak.

`Work` is one unit of host work (a zero-argument-per-attempt coroutine
function with its key, priority, timeout and `Resources`); `WorkResult` is how
it ended. Both sides import these types and neither imports the other.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any


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


INFRA_ERROR = "infra_error"

class InfraError(Exception):
  """An infrastructure fault (lost worker, full disk): the only failure retried."""


@dataclasses.dataclass(frozen=True)
class Retry:
  """Backoff for infrastructure faults."""

  attempts: int = 3  # tries in all, the first included
  base_s: float = 0.1  # delay before the first retry; doubles each time
  max_s: float = 10.0  # longest delay
  jitter: float = 0.5  # each delay is cut by a random fraction up to this

  def __post_init__(self):
    if self.attempts < 1:
      raise ValueError(f"Retry.attempts must be >= 1, got {self.attempts}")
    if self.base_s < 0 or self.max_s < 0 or not 0 <= self.jitter <= 1:
      raise ValueError(f"Retry.base_s, max_s must be >= 0 and jitter in [0, 1], got {self}")

  def delay(self, attempt: int, rng: random.Random) -> float:
    """Seconds to wait after failed attempt number `attempt` (1-based)."""
    return min(self.max_s, self.base_s * 2 ** (attempt - 1)) * (1 - self.jitter * rng.random())


@dataclasses.dataclass(frozen=True)
class Work:
  """One unit of work for `Scheduler.run`; for a remote executor (Ray) `fn` must pickle, with what it captures.

  A keeping job (`keeps`) leaves part of what it made where it ran: the executor hands back a handle of it
  (`Executor.fetch` reads it), which a later job takes in its `args`. So state that goes from job to job (a
  workspace's snapshot) need not travel through the caller each time; see `ptx.scheduling.executors`.
  """

  fn: Callable[..., Awaitable[Any]]  # called once per attempt, on `args`
  key: Hashable = None  # the caller's name for it, echoed in the result
  priority: int = 0  # higher starts first
  timeout_s: float | None = None  # per attempt, from its start; None: the scheduler's default
  resources: Resources | None = None  # what an attempt reserves where it runs; None: the executor's default
  args: tuple = ()  # fn(*args) at each attempt: values, or handles a keeping job returned (resolved where it runs)
  keeps: bool = False  # fn returns (value, kept); the job's value is (value, a handle of kept where it was made)


@dataclasses.dataclass(frozen=True)
class WorkResult:
  """How one unit of work ended."""

  key: Hashable
  outcome: str
  value: Any  # what the last attempt returned; None when it raised
  attempts: int
  error: str = ""  # the exception of the last attempt, if any
