"""Warm pools: the workspaces episodes start from, prepared ahead of need.

A task's initial state (`InitialState`) is its files and, when it has one, a
set-up command run once on them in the sandbox (generate data, build, make a
repository); the workspace it leaves is where an episode starts. `prepare` is
the one way to make it, whether a pool does it ahead or an episode does it
when it starts, so the two give the same bytes for a deterministic set-up.

Named by content, checked at checkout. `InitialState.key` hashes the files and
the set-up, so the same (task, seed) of a pure task source
(`TerminalTasks(seed)[i]`) always has the same key and a key cannot stand for
two states. A `Prepared` workspace carries the SHA-256 of its snapshot, and
the pool keeps that digest apart from the bytes it hands around: a `Lease`
hashes the snapshot again when it opens the workspace and refuses bytes that
changed since (`Tampered`, an infrastructure fault). `verify=True` prepares
each state twice and refuses one whose set-up is not deterministic
(`NotReproducible`). Set-up runs with SOURCE_DATE_EPOCH=0 and TZ=UTC.

Prepared once, opened once per episode. A workspace lives as bytes, never as
a host directory (`ptx.sandbox.run`): each run unpacks the snapshot into a
fresh sandbox and an episode's changes become a new snapshot of its own
`Workspace`. So a pool prepares each state once and every checkout opens a
`Workspace` of its own from those bytes: the G episodes of a GRPO group start
from one preparation, from identical bytes, and no episode sees another's
changes; no `Workspace` is handed to two episodes.

`WarmPool` prepares the states it is told to `expect` in the background and
holds them; a checkout of a state not held asks for it at once, ahead of the
expected ones. Bounds: `size` states held or being prepared ahead and
`max_bytes` of held snapshots; a held state that no expected checkout still
needs is evicted when room is wanted, least recently used first, and one
still expected never is, so read-ahead pauses when the pool is full and
resumes as checkouts come. Preparations are jobs of the pool's own
`Scheduler`, so they get its concurrency limit, timeouts, priorities
(demanded first) and retries: a failed set-up is an `InfraError`, retried,
and when retries are spent each episode waiting for it ends as an
infrastructure error, never as the model's failure. The pool writes nothing
to the host's disk (a set-up's disk is the sandbox's capped tmpfs), and
`close()` drops everything it holds.

On Ray (`WarmPool(executor=RayExecutor(...))`) preparations are Ray tasks on
the CPU nodes under the scheduler's rules like any job: the set-up's CPU is
spent on the nodes, not on the trainer's host, and a preparation lost with
its node runs again elsewhere. Snapshots come back to the pool as bytes (an
episode's commands then keep theirs in Ray's object store: `ShellEnv`). Not
an actor per node holding its workspaces: any node can start from a
snapshot, so pinning one to the node that made it would need node-affine
placement of episodes, which `RayExecutor` leaves to Ray's balancing, and a
node's death would take its workspaces with it. The cost is moving each
prepared snapshot to the trainer and out again, once per episode: small for
source trees (kilobytes); set-ups that make large data would want prepared
snapshots kept in Ray's object store too.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import threading
from collections.abc import Callable, Iterable, Mapping

from ptx.scheduling import offload, scheduler

from ptx.sandbox import run as sandbox
from ptx.scheduling.executors import Executor

SETUP_LIMITS = sandbox.Limits(timeout_s=60.0, cpu_s=60)  # what one set-up run may use
_SETUP_ENV = {"SOURCE_DATE_EPOCH": "0", "TZ": "UTC"}  # fixed dates for tools that stamp them
_CLOSED = "the warm pool closed before the workspace was prepared"


class Tampered(scheduler.InfraError):
  """A prepared workspace whose bytes are not the ones its state prepares."""


class NotReproducible(scheduler.InfraError):
  """A state whose set-up gave different workspaces when run twice."""


@dataclasses.dataclass(frozen=True)
class InitialState:
  """Where an episode starts: files, then a set-up command run once on them; named by its content."""

  key: str  # SHA-256 of the set-up and the files' snapshot
  files: bytes  # `ptx.sandbox.inside.workspace` snapshot of the files
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


async def _prepare_job(state: InitialState, limits: sandbox.Limits, verify: bool) -> Prepared:
  """A scheduler job preparing `state`, twice when verifying (module-level, so that it pickles for Ray)."""
  prepared = await scheduler.to_thread(prepare, state, limits)
  if verify and (again := await scheduler.to_thread(prepare, state, limits)).digest != prepared.digest:
    raise NotReproducible(f"state {state.key[:12]} prepared to {prepared.digest[:12]} and then to "
                          f"{again.digest[:12]}: its set-up is not deterministic")
  return prepared


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
  def inline(cls, state: InitialState, limits: sandbox.Limits = SETUP_LIMITS,
             calls: offload.Offload = offload.Offload()) -> Lease:
    """A lease that prepares `state` itself when first opened (no pool): a set-up through `calls` (default: right
    here); files alone need no run, so they are not sent anywhere."""

    def wait():
      prepared = calls.call(prepare, state, limits) if state.setup else prepare(state, limits)
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
  """Prepares expected initial states ahead, in the background; each checkout opens a workspace of its own.

  Args:
    size: states held prepared or being prepared ahead (a checkout of one not held asks past this).
    max_bytes: snapshot bytes held.
    concurrency: preparations running at once.
    executor: where they run (`ptx.scheduling.executors`); None: threads of this process.
    limits: what one set-up run may use.
    retry: retries of a failed preparation (an infrastructure fault).
    verify: prepare each state twice and refuse it when the two differ (`NotReproducible`).
  """

  def __init__(self, *, size: int = 64, max_bytes: int = 1 << 30, concurrency: int = 2,
               executor: Executor | None = None, limits: sandbox.Limits = SETUP_LIMITS,
               retry: scheduler.Retry = scheduler.Retry(), verify: bool = False):
    if size < 1 or max_bytes < 1:
      raise ValueError(f"WarmPool.size and max_bytes must be >= 1, got {size}, {max_bytes}")
    self.size, self.max_bytes, self.limits, self.verify = size, max_bytes, limits, verify
    self.stats: collections.Counter[str] = collections.Counter()  # prepared, handed_out, hits, misses, failed, ...
    self._held: collections.OrderedDict[str, Prepared] = collections.OrderedDict()  # least recently used first
    self._digest: dict[str, str] = {}  # of each held state, kept apart from the Prepared handed around
    self._held_bytes = 0
    self._ahead = self._ahead_bytes = 0  # preparations in flight for `expect`, and the bytes they are expected to take
    self._last_bytes = 0  # of the last snapshot prepared: what the next one will likely take
    self._due: collections.Counter[str] = collections.Counter()  # expected checkouts not yet made, per key
    self._wanted: collections.OrderedDict[str, InitialState] = collections.OrderedDict()  # to prepare ahead
    self._waiters: dict[str, list[concurrent.futures.Future]] = {}  # keys in flight -> their checkouts
    self._closed = False
    # Preparations are jobs: a timeout past the set-up's own bounds only ends a lost remote task.
    self._scheduler = scheduler.Scheduler(concurrency, timeout_s=(2 + 2 * verify) * limits.timeout_s + 30,
                                          retry=retry, executor=executor)
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, name="ptx-warm-pool", daemon=True)
    self._thread.start()

  def expect(self, states: Iterable[InitialState]) -> None:
    """Says which states the next checkouts will ask for, once per checkout; prepares them ahead."""
    self._call(self._expect, list(states))

  def checkout(self, state: InitialState) -> Lease:
    """A workspace of `state` of its own: from the held snapshot, one being prepared, or one asked for now.

    Returns:
      The Lease; its `workspace()` waits for the preparation and raises InfraError when it failed.
    """
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._call(self._claim, state, future)
    return Lease(future.result, future.cancel)

  def held(self) -> int:
    """States prepared and held."""
    return len(self._held)

  def in_flight(self) -> int:
    """Preparations running or queued in the scheduler."""
    return len(self._waiters)

  def close(self) -> None:
    """Stops preparing, fails the checkouts still waiting, drops every held snapshot."""
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
    for state in states:
      self._due[state.key] += 1
      if state.key not in self._held and state.key not in self._waiters:
        self._wanted[state.key] = state
    self._fill()

  def _claim(self, state: InitialState, future: concurrent.futures.Future) -> None:
    key = state.key
    if self._due[key] > 1:
      self._due[key] -= 1
    else:
      self._due.pop(key, None)
    if key in self._held:
      self.stats["hits"] += 1
      self._held.move_to_end(key)
      self._give(future, self._held[key])
    else:
      self.stats["misses"] += 1
      if key not in self._waiters:
        self._wanted.pop(key, None)
        self._submit(state, ahead=False)
      self._waiters[key].append(future)
    self._fill()

  def _give(self, future: concurrent.futures.Future, prepared: Prepared) -> None:
    if future.set_running_or_notify_cancel():
      self.stats["handed_out"] += 1
      future.set_result((prepared, self._digest[prepared.key]))

  def _fill(self) -> None:
    """Starts expected preparations while the pool, after evicting what no expected checkout needs, has room."""
    while self._wanted and not self._closed and self._room(self._estimate(next(iter(self._wanted.values())))):
      self._submit(self._wanted.popitem(last=False)[1], ahead=True)

  def _room(self, nbytes: int) -> bool:
    """Whether one more state of `nbytes` fits, after evicting held states no expected checkout needs (LRU).

    A preparation ahead counts its `_estimate` until it ends (one that takes more may then be dropped).
    """
    def fits():
      return (len(self._held) + self._ahead < self.size
              and self._held_bytes + self._ahead_bytes + nbytes <= self.max_bytes)

    for key in [k for k in self._held if self._due[k] == 0]:
      if fits():
        break
      self._held_bytes -= len(self._held.pop(key).snapshot)
      self._digest.pop(key)
      self.stats["evicted"] += 1
    return fits()

  def _estimate(self, state: InitialState) -> int:
    """Bytes `state` will likely take once prepared: its files, or what the last preparation took if more."""
    return max(len(state.files), self._last_bytes)

  def _submit(self, state: InitialState, ahead: bool) -> None:
    self._waiters[state.key] = []
    estimate = self._estimate(state) if ahead else 0
    self._ahead += ahead
    self._ahead_bytes += estimate
    job = scheduler.Work(functools.partial(_prepare_job, state, self.limits, self.verify), key=("prepare", state.key),
                        priority=0 if ahead else 1)
    self._scheduler.submit(job).add_done_callback(functools.partial(self._done, state.key, ahead, estimate))

  def _done(self, key: str, ahead: bool, estimate: int, future: asyncio.Future) -> None:
    """One preparation ended: its checkouts get it (or the fault), and the pool holds it if it fits."""
    waiters = self._waiters.pop(key, [])  # none once closed
    self._ahead -= ahead
    self._ahead_bytes -= estimate
    self.stats["retries"] = self._scheduler.retries
    result = None if future.cancelled() or self._closed else future.result()
    if result is None:
      _fail(waiters, _CLOSED)
    elif result.outcome != "ok":
      self.stats["failed"] += 1
      _fail(waiters, f"preparing the workspace failed: {result.outcome} {result.error}")
    else:
      prepared = result.value
      self.stats["prepared"] += 1
      self._last_bytes = len(prepared.snapshot)
      self._digest[key] = prepared.digest
      for waiter in waiters:
        self._give(waiter, prepared)
      if self._room(len(prepared.snapshot)):
        self._held[key] = prepared
        self._held_bytes += len(prepared.snapshot)
      else:
        self._digest.pop(key)
        self.stats["dropped"] += 1
    self._fill()

  async def _shutdown(self) -> None:
    await self._scheduler.close()
    for waiters in self._waiters.values():
      _fail(waiters, _CLOSED)
    self._waiters.clear()
    self._held.clear()
    self._wanted.clear()
    self._held_bytes = 0
    await self._loop.shutdown_default_executor()


def _fail(waiters: list[concurrent.futures.Future], why: str) -> None:
  """Ends each checkout still waiting with an InfraError saying why."""
  for waiter in waiters:
    if waiter.set_running_or_notify_cancel():
      waiter.set_exception(scheduler.InfraError(why))
