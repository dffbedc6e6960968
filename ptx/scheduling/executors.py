"""Where a scheduled job's attempts run: the executor seam under `ptx.scheduling.scheduler.Scheduler`.

The scheduler owns every rule about jobs (the concurrency limit, priorities,
timeouts, which failures are retried, the outcome counts); an executor decides
only where an attempt runs. `LocalExecutor`, the default, awaits the job in the
scheduler's own event loop, as the scheduler always has; `ptx.scheduling.ray_executor`
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

import functools
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ptx.scheduling.work import Resources, Work

Attempt = Callable[[], Awaitable[Any]]


class Executor(Protocol):
  """Runs the attempts of the jobs a scheduler hands it."""

  def bind(self, job: Work) -> Attempt:
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

  def bind(self, job: Work) -> Attempt:
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
