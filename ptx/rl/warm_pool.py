"""Warm pools: the workspaces episodes start from, prepared ahead of need, each handed out once.

A task's initial state (`InitialState`) is its files and, when it has one, a
set-up command run once on them in the sandbox (generate data, build, make a
repository); the workspace it leaves is where the episode starts. Preparing
it (`prepare`) is the same code whether a pool did it ahead or an episode
does it when it starts, so the two give the same bytes.

Reproducible and checked. A state is named by its content: `InitialState.key`
hashes the files and the set-up, so the same (task, seed) of a pure task
source (`TerminalTasks(seed)[i]`) always has the same key, and a key cannot
stand for two states. A prepared workspace (`Prepared`) carries the SHA-256
of its snapshot. The pool keeps, per key, the digest of its first preparation
as the reference: a later preparation that differs (a set-up that is not
deterministic) is refused as an infrastructure fault, and a `Lease` hashes
the snapshot again when it hands the workspace out, so bytes changed after
preparation (in the pool, in transit) are never used. Set-up runs with
SOURCE_DATE_EPOCH=0 and TZ=UTC, for tools that stamp dates.

`WarmPool` prepares the states it is told to `expect` in the background, up
to `size` workspaces held or being made and `max_bytes` of held snapshots,
and refills as `checkout` takes them; a checkout whose state is not ready
asks for it at once, ahead of the expected ones. Each prepared workspace goes
to exactly one lease and is used by one episode (a policy's commands change
it). Preparations are jobs of the pool's own `Scheduler`, so they get its
concurrency limit, timeouts, priorities (demanded first) and retries: a
failed set-up is an `InfraError`, retried, and when retries are spent the
episode that needed it ends as an infrastructure error, never as the model's
failure. Held workspaces are bytes in memory (a workspace never lives as a
host directory, see `ptx.rl.sandbox`): the pool writes nothing to the host's
disk, a set-up's disk is the sandbox's capped tmpfs, and `close()` drops
everything.

On Ray (`WarmPool(executor=RayExecutor(...))`) the preparations are Ray tasks
on the CPU nodes, with the scheduler's rules as for any job: the set-up's CPU
is spent on the nodes, not on the trainer's host, and a preparation lost with
its node runs again elsewhere. The snapshots come back to the pool as bytes.
Not an actor per node holding its workspaces: a workspace is bytes that any
node can start from, so pinning it to the node that made it would need
node-affine placement of episodes, which `RayExecutor` leaves to Ray's
balancing, and it would lose the workspaces with the node. The cost is moving
each snapshot twice, small for source trees (kilobytes) and the reason to
keep large data out of set-ups until workspaces stay in Ray's object store.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from ptx.rl import sandbox, scheduler
from ptx.rl.executors import Executor

SETUP_LIMITS = sandbox.Limits(timeout_s=60.0, cpu_s=60)  # what one set-up run may use
_SETUP_ENV = {"SOURCE_DATE_EPOCH": "0", "TZ": "UTC"}  # fixed dates for tools that stamp them


class Tampered(scheduler.InfraError):
  """A prepared workspace whose bytes are not the ones its state prepares."""


@dataclasses.dataclass(frozen=True)
class InitialState:
  """Where an episode starts: files, then a set-up command run once on them; named by its content."""

  key: str  # SHA-256 of the set-up and the files' snapshot
  files: bytes  # `workspace_format` snapshot of the files
  setup: str = ""  # `sh -c` command run in the sandbox on the files; "" for none

  @classmethod
  def of(cls, files: Mapping[str, str | bytes], setup: str = "") -> InitialState:
    """The state of `files` (relative path -> content) and `setup`.

    Raises:
      ValueError: a file name that leaves the workspace.
    """
    snapshot = sandbox.Workspace(files).snapshot
    key = hashlib.sha256(setup.encode() + b"\0" + snapshot).hexdigest()
    return cls(key, snapshot, setup)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A workspace made from an InitialState: its snapshot and that snapshot's SHA-256 when it was made."""

  key: str
  snapshot: bytes
  digest: str


def prepare(state: InitialState, limits: sandbox.Limits = SETUP_LIMITS) -> Prepared:
  """Makes the workspace of `state`: its files, after its set-up ran in the sandbox.

  Args:
    state: the initial state.
    limits: what the set-up run may use.

  Returns:
    The Prepared workspace.

  Raises:
    scheduler.InfraError: the set-up did not exit 0 (it is the task's, never the model's).
  """
  snapshot = state.files
  if state.setup:
    workspace = sandbox.Workspace()
    workspace.snapshot = state.files
    result = sandbox.run(["sh", "-c", state.setup], limits=limits, workspace=workspace, env=_SETUP_ENV)
    if result.outcome != sandbox.Outcome.OK:
      raise scheduler.InfraError(f"the set-up of state {state.key[:12]} ended {result.outcome}: {result.reason}")
    snapshot = workspace.snapshot
  return Prepared(state.key, snapshot, hashlib.sha256(snapshot).hexdigest())


async def _prepare_job(state: InitialState, limits: sandbox.Limits) -> Prepared:
  """A scheduler job preparing `state` (module-level, so that it pickles for Ray)."""
  return await scheduler.to_thread(prepare, state, limits)


class Lease:
  """One workspace for one episode: `workspace()` waits for it, checks its bytes, and opens it once.

  Args:
    wait: returns the Prepared workspace and the digest it must have (or raises why there is none).
    cancel: gives up the claim on a workspace not yet prepared.
  """

  def __init__(self, wait: Callable[[], tuple[Prepared, str]], cancel: Callable[[], object] = lambda: None):
    self._wait, self._cancel = wait, cancel
    self._workspace: sandbox.Workspace | None = None
    self._lock = threading.Lock()

  @classmethod
  def inline(cls, state: InitialState, limits: sandbox.Limits = SETUP_LIMITS) -> Lease:
    """A lease that prepares `state` itself when first opened (no pool)."""

    def wait():
      prepared = prepare(state, limits)
      return prepared, prepared.digest

    return cls(wait)

  def workspace(self) -> sandbox.Workspace:
    """The episode's workspace (the same one on every call); blocks until it is prepared.

    Raises:
      scheduler.InfraError: it could not be prepared, or its bytes are not the state's (`Tampered`).
    """
    with self._lock:
      if self._workspace is None:
        prepared, reference = self._wait()
        digest = hashlib.sha256(prepared.snapshot).hexdigest()
        if digest != prepared.digest or digest != reference:
          raise Tampered(f"the workspace of state {prepared.key[:12]} hashes to {digest[:12]}, not to "
                         f"{reference[:12]}: it was changed after it was prepared")
        self._workspace = sandbox.Workspace()
        self._workspace.snapshot = prepared.snapshot
      return self._workspace

  def close(self) -> None:
    """Drops the workspace, or gives up the claim on one not yet prepared."""
    self._cancel()
    if self._workspace is not None:
      self._workspace.close()


class WarmPool:
  """Prepares expected initial states ahead, in the background; hands each workspace out once.

  Args:
    size: workspaces held ready or being prepared ahead (a checkout that finds none asks past this).
    max_bytes: snapshot bytes held ready.
    concurrency: preparations running at once.
    executor: where they run (`ptx.rl.executors`); None: threads of this process.
    limits: what one set-up run may use.
    retry: retries of a failed preparation (an infrastructure fault).
  """

  def __init__(self, *, size: int = 64, max_bytes: int = 1 << 30, concurrency: int = 2,
               executor: Executor | None = None, limits: sandbox.Limits = SETUP_LIMITS,
               retry: scheduler.Retry = scheduler.Retry()):
    if size < 1 or max_bytes < 1:
      raise ValueError(f"WarmPool.size and max_bytes must be >= 1, got {size}, {max_bytes}")
    self.size, self.max_bytes, self.limits = size, max_bytes, limits
    self.stats: collections.Counter[str] = collections.Counter()  # prepared, handed_out, hits, misses, failed, ...
    self._ready: dict[str, collections.deque[Prepared]] = collections.defaultdict(collections.deque)
    self._ready_count = self._ready_bytes = self._ahead = 0  # _ahead: expected preparations in flight
    self._wanted: collections.deque[InitialState] = collections.deque()
    self._waiters: dict[str, collections.deque[concurrent.futures.Future]] = collections.defaultdict(
        collections.deque)
    self._pending: collections.Counter[str] = collections.Counter()  # preparations in flight, per key
    self._reference: dict[str, str] = {}
    self._closed = False
    # Preparations are jobs: a timeout past the set-up's own bounds only a lost remote task.
    self._scheduler = scheduler.Scheduler(concurrency, timeout_s=2 * limits.timeout_s + 30, retry=retry,
                                          executor=executor)
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, name="ptx-warm-pool", daemon=True)
    self._thread.start()

  def expect(self, states: Iterable[InitialState]) -> None:
    """Queues one workspace per state given (a state twice: two workspaces) to prepare ahead."""
    states = list(states)
    self._call(self._expect, states)

  def checkout(self, state: InitialState) -> Lease:
    """Claims a workspace of `state`: a ready one, one being prepared, or one asked for now.

    Returns:
      The Lease; its `workspace()` waits for the preparation and raises InfraError when it failed.
    """
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._call(self._claim, state, future)
    return Lease(future.result, future.cancel)

  def ready(self) -> int:
    """Workspaces prepared and not yet claimed."""
    return self._ready_count

  def in_flight(self) -> int:
    """Preparations running or queued in the scheduler."""
    return sum(self._pending.values())

  def close(self) -> None:
    """Stops preparing, fails the checkouts still waiting, drops every held workspace."""
    if self._closed:
      return
    self._closed = True
    asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join()
    self._loop.close()

  def __enter__(self) -> WarmPool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _call(self, fn, *args) -> None:
    if self._closed:
      raise RuntimeError("WarmPool used after close()")
    self._loop.call_soon_threadsafe(fn, *args)

  # Everything below runs in the pool's loop thread, so the state needs no lock.

  def _expect(self, states: list[InitialState]) -> None:
    self._wanted.extend(states)
    self._fill()

  def _claim(self, state: InitialState, future: concurrent.futures.Future) -> None:
    ready = self._ready[state.key]
    if ready:
      self.stats["hits"] += 1
      if self._give(collections.deque([future]), ready[0]):
        self._ready_count -= 1
        self._ready_bytes -= len(ready.popleft().snapshot)
      self._fill()
      return
    self.stats["misses"] += 1
    waiters = self._waiters[state.key]
    waiters.append(future)
    if self._live(waiters) > self._pending[state.key]:
      self._submit(state, ahead=False)

  def _give(self, waiters: collections.deque[concurrent.futures.Future], prepared: Prepared) -> bool:
    """Hands `prepared` to the oldest waiter not cancelled; False when there is none."""
    while waiters:
      future = waiters.popleft()
      if future.set_running_or_notify_cancel():  # from here on the waiter cannot cancel: it is handed out once
        self.stats["handed_out"] += 1
        future.set_result((prepared, self._reference[prepared.key]))
        return True
    return False

  @staticmethod
  def _live(waiters: collections.deque[concurrent.futures.Future]) -> int:
    return sum(not f.cancelled() for f in waiters)

  def _fill(self) -> None:
    """Starts expected preparations while the pool is under its size and bytes."""
    while (self._wanted and not self._closed and self._ready_count + self._ahead < self.size
           and self._ready_bytes < self.max_bytes):
      self._submit(self._wanted.popleft(), ahead=True)

  def _submit(self, state: InitialState, ahead: bool) -> None:
    self._pending[state.key] += 1
    self._ahead += ahead
    job = scheduler.Job(functools.partial(_prepare_job, state, self.limits), key=("prepare", state.key),
                        priority=0 if ahead else 1)
    self._scheduler.submit(job).add_done_callback(functools.partial(self._done, state.key, ahead))

  def _done(self, key: str, ahead: bool, future: asyncio.Future) -> None:
    """One preparation ended: to its oldest waiter, else ready; a failure to a waiter no other one covers."""
    self._pending[key] -= 1
    self._ahead -= ahead
    self.stats["retries"] = self._scheduler.retries
    if future.cancelled() or self._closed:
      return
    result, waiters = future.result(), self._waiters[key]
    prepared, error = result.value, "" if result.outcome == "ok" else f"{result.outcome} {result.error}"
    if result.outcome == "ok" and self._reference.setdefault(key, prepared.digest) != prepared.digest:
      error = (f"state {key[:12]} prepared to {prepared.digest[:12]}, not to {self._reference[key][:12]} as "
               "before: its set-up is not reproducible")
      logging.getLogger(__name__).warning("warm pool: %s", error)
    if error:
      self.stats["failed"] += 1
      while self._live(waiters) > self._pending[key]:
        failed = waiters.popleft()
        if failed.set_running_or_notify_cancel():
          failed.set_exception(scheduler.InfraError(f"preparing the workspace failed: {error}"))
          break
    else:
      self.stats["prepared"] += 1
      if not self._give(waiters, prepared):
        if self._ready_bytes + len(prepared.snapshot) > self.max_bytes:
          self.stats["dropped"] += 1
        else:
          self._ready[key].append(prepared)
          self._ready_count += 1
          self._ready_bytes += len(prepared.snapshot)
    self._fill()

  async def _shutdown(self) -> None:
    await self._scheduler.close()
    for waiters in self._waiters.values():
      for future in waiters:
        if not future.cancelled():
          future.set_exception(scheduler.InfraError("the warm pool closed before the workspace was prepared"))
    self._waiters.clear()
    self._ready.clear()
    self._wanted.clear()
    self._ready_count = self._ready_bytes = 0
    await self._loop.shutdown_default_executor()
