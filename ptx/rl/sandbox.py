"""Runs untrusted programs confined: the only place model-written code executes.

Each run gets its own session and process group, a private directory (a fresh
temporary one unless the caller passes a `Workspace`), a scrubbed environment,
rlimits on CPU seconds, address space, file size, processes and open files, a
new network namespace where the OS allows it, a wall-clock timeout that kills
the whole group, and caps on captured output (a run that prints past its cap is
killed). The child side lives in `sandbox_child.py`.

When the caller is root, every workspace also gets a fresh unprivileged uid:
the program cannot signal, trace or read the environment of any other process,
cannot change files it does not own, and RLIMIT_NPROC (which root ignores)
binds. It also gets a filesystem root of its own: the host's system
directories (/usr, /etc, /bin, /lib...), /dev and /proc, its workspace, and empty
private /tmp, /var/tmp and /dev/shm (a small tmpfs that vanishes with the run).
It cannot see home directories, datasets or the repository, and the only
lasting place it can write is its workspace. After each run every process of that uid is killed, including ones
that escaped the process group. Without root those protections are weaker and
the result says so in `notes`.

Linux only (`os.pidfd_open`, /proc, namespaces). Thread-safe: runs may proceed
concurrently from many threads.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from ptx.rl import strays

_CHILD = str(pathlib.Path(__file__).with_name("sandbox_child.py"))
_BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
             "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
# Python's own messages when an rlimit stops it (it ignores SIGXFSZ).
_LIMIT_MESSAGES = (b"MemoryError", b"[Errno 12] Cannot allocate memory", b"[Errno 27] File too large",
                   b"[Errno 11] Resource temporarily unavailable", b"[Errno 24] Too many open files")
_DRAIN_S = 0.5  # how long to wait for pipe EOF after the program exits


class Outcome(enum.StrEnum):
  """How a run ended."""

  OK = "ok"  # exit status 0
  FAILED = "failed"  # nonzero exit status
  TIMEOUT = "timeout"  # killed at the wall-clock limit
  CRASHED = "crashed"  # killed by a signal it did not ask for (SIGSEGV, SIGABRT...)
  LIMIT = "limit"  # stopped by an rlimit or the output cap
  INFRA_ERROR = "infra_error"  # could not be started: not the program's fault


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one run may use."""

  timeout_s: float = 10.0  # wall clock; then the whole process group is killed
  cpu_s: int = 10  # CPU seconds (SIGXCPU, then SIGKILL a second later)
  memory_bytes: int = 1 << 30  # address space per process
  file_bytes: int = 16 << 20  # largest file it may write
  processes: int = 64  # processes of its uid (of the caller's uid when not root)
  open_files: int = 64  # open file descriptors per process
  output_bytes: int = 1 << 16  # captured per stream; printing more kills the run

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not getattr(self, field.name) > 0:
        raise ValueError(f"Limits.{field.name} must be > 0, got {getattr(self, field.name)!r}")


@dataclasses.dataclass(frozen=True)
class Usage:
  """Resources the program used (its reaped descendants included).

  `max_rss_bytes` is Linux's ru_maxrss of the launched process, which keeps
  the peak of the process that spawned it across fork and exec: under a
  large parent (a JAX trainer) it reports at least the parent's size. The
  memory limit itself is enforced by RLIMIT_AS and shows in `outcome`.
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
  uid: int | None  # the run's own uid; None when the caller was not root
  reason: str  # one line for people: "exit 1", "killed by SIGXCPU (cpu limit)"
  notes: tuple[str, ...] = ()  # protections that could not be applied

  @property
  def stdout_text(self) -> str:
    """Standard output decoded as UTF-8 (bad bytes replaced)."""
    return self.stdout.decode("utf-8", "replace")

  @property
  def stderr_text(self) -> str:
    """Standard error decoded as UTF-8 (bad bytes replaced)."""
    return self.stderr.decode("utf-8", "replace")


class Workspace:
  """A private directory, and when root a private uid, shared by several runs.

  Args:
    files: relative path -> content, written before the first run.
  """

  def __init__(self, files: Mapping[str, str | bytes] | None = None):
    self.path = pathlib.Path(tempfile.mkdtemp(prefix="ptx-sandbox-"))
    # A random uid in a range no system assigns: collisions are negligible even
    # across processes, and no file on the host belongs to it.
    self.uid = 3_000_000_000 + secrets.randbelow(1_000_000_000) if os.geteuid() == 0 else None
    try:
      self._own(self.path)
      self.write(files or {})
    except BaseException:
      shutil.rmtree(self.path, ignore_errors=True)
      raise

  def write(self, files: Mapping[str, str | bytes]) -> None:
    """Writes `files` (relative path -> content) into the workspace (between runs only)."""
    root = self.path.resolve()
    for name, content in files.items():
      target = self.path / name
      # resolve() follows any symlink a run planted, so this also refuses
      # writing through one to a file outside.
      if pathlib.PurePath(name).is_absolute() or root not in target.resolve().parents:
        raise ValueError(f"Workspace file name must stay inside the workspace, got {name!r}")
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_bytes(content.encode() if isinstance(content, str) else content)
      for path in (target, *target.relative_to(self.path).parents):
        self._own(self.path / path)

  def _own(self, path: pathlib.Path) -> None:
    """Gives `path` to the workspace's uid (when it has one)."""
    if self.uid is not None:
      os.lchown(path, self.uid, self.uid)

  def close(self) -> None:
    """Kills what is left of the workspace's processes and deletes it."""
    if self.uid is not None:
      strays.kill_user(self.uid, _CHILD)
    # rmtree does not follow the symlinks a program may have planted.
    shutil.rmtree(self.path, ignore_errors=True)

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
    files: relative path -> content written into the directory first.
    stdin: fed to the program's standard input (else it reads EOF).
    workspace: run there (and as its uid); by default a fresh one is made and
      deleted afterwards.
    env: extra environment variables; nothing else of the caller's leaks in.
    cut_network: run in a new network namespace (no interfaces up).
    pass_fds: descriptors the program inherits at the same numbers (pipe ends
      linking it to another run); `run` owns them and closes them once the
      program has started, so the peer sees EOF when the program exits.

  Returns:
    The SandboxResult.
  """
  if isinstance(argv, (str, bytes)) or not argv or not all(isinstance(a, str) for a in argv):
    raise ValueError(f"run: argv must be a non-empty list of str (the program and its arguments), got {argv!r}")
  try:
    if workspace is None:
      try:
        workspace = Workspace(files)
      except OSError as e:
        return _infra(f"could not make the workspace: {e}")
      with workspace:
        return _run_in(list(argv), workspace, limits, stdin, env, cut_network, tuple(pass_fds))
    workspace.write(files or {})
    return _run_in(list(argv), workspace, limits, stdin, env, cut_network, tuple(pass_fds))
  finally:
    _close_all(pass_fds)


def _close_all(fds: Sequence[int]) -> None:
  for fd in fds:
    try:
      os.close(fd)
    except OSError:
      pass  # closed already, once the program started


def _infra(reason: str, uid: int | None = None) -> SandboxResult:
  return SandboxResult(Outcome.INFRA_ERROR, None, b"", b"", False, Usage(0.0, 0.0, 0.0, 0), False, uid, reason)


def _run_in(argv: list[str], ws: Workspace, limits: Limits, stdin: bytes | str | None,
            env: Mapping[str, str] | None, cut_network: bool, pass_fds: tuple[int, ...]) -> SandboxResult:
  """Starts the child launcher and collects the run."""
  status_r, status_w = os.pipe()
  config = {"argv": argv, "uid": ws.uid, "status_fd": status_w, "cut_network": cut_network,
            "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
            "processes": limits.processes, "open_files": limits.open_files}
  started = time.monotonic()
  try:
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", _CHILD, json.dumps(config)], cwd=ws.path,
        env={**_BASE_ENV, "HOME": str(ws.path), "TMPDIR": str(ws.path), **(env or {})},
        stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, pass_fds=(status_w, *pass_fds))
  except OSError as e:
    os.close(status_r)
    return _infra(f"could not start the sandbox: {e}", ws.uid)
  finally:
    _close_all((status_w, *pass_fds))
  data = stdin.encode() if isinstance(stdin, str) else stdin
  capture = _Capture(proc, status_r, data, limits, ws.uid)
  capture.collect(started + limits.timeout_s)
  return capture.result(limits, time.monotonic() - started)


class _Capture:
  """Feeds stdin, reads capped output and the child's status, enforces the deadline."""

  def __init__(self, proc: subprocess.Popen, status_r: int, stdin: bytes | None, limits: Limits,
               uid: int | None):
    self.proc, self.uid, self.cap = proc, uid, limits.output_bytes
    self.stdin = memoryview(stdin or b"")
    self.out = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
    self.killed_for = ""  # why we killed it, if we did
    self.truncated = False
    self.rusage = None
    self.survivors: list[int] = []  # processes of the uid that would not die
    self.sel = selectors.DefaultSelector()
    self.pidfd = os.pidfd_open(proc.pid)
    self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
    self.sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    self.sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    self.sel.register(status_r, selectors.EVENT_READ, "status")
    if proc.stdin is not None:
      os.set_blocking(proc.stdin.fileno(), False)
      self.sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")

  def kill(self, why: str) -> None:
    """Kills the whole group once, remembering why (strays of the uid die at exit)."""
    if not self.killed_for:
      self.killed_for = why
      _kill_group(self.proc.pid)

  def collect(self, deadline: float) -> None:
    """Runs the event loop until the program has exited and the pipes are drained."""
    exited_at = None
    while self.sel.get_map():
      now = time.monotonic()
      if exited_at is None and now >= deadline:
        self.kill("timeout")
      if exited_at is not None and now >= exited_at + _DRAIN_S:
        break  # a stray that escaped us still holds a pipe: stop waiting for it
      wait = exited_at + _DRAIN_S - now if exited_at is not None else max(0.0, deadline - now)
      for key, _ in self.sel.select(timeout=max(wait, 0.01) if self.killed_for else wait):
        if key.data == "exit":
          self._on_exit()
          exited_at = time.monotonic()
        elif key.data == "stdin":
          self._feed(key.fileobj)
        else:
          self._read(key)
    for key in list(self.sel.get_map().values()):
      self._close(key.fileobj)
    self.sel.close()

  def _on_exit(self) -> None:
    # The exited leader is a zombie until wait4, so its pgid cannot be reused
    # yet: kill the rest of the group first, then the uid's escapees.
    _kill_group(self.proc.pid)
    if self.uid is not None:
      self.survivors = strays.kill_user(self.uid, _CHILD)
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
    fd = key.fd
    chunk = os.read(fd, 1 << 16)
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

  def result(self, limits: Limits, wall_s: float) -> SandboxResult:
    """Classifies the finished run."""
    lines = [json.loads(line) for line in self.out["status"].decode().splitlines() if line]
    report = {k: v for line in lines for k, v in line.items()}
    net_error = report.get("net_error", "the child did not report")
    notes = [] if not net_error else [f"network not isolated: {net_error}"]
    if report.get("root_error"):
      notes.append(f"the host filesystem is visible: {report['root_error']}")
    if self.survivors:
      notes.append(f"processes {self.survivors} of uid {self.uid} survived SIGKILL")
    if self.uid is None:
      notes.append("not root: runs as the caller's uid (can signal the caller's processes) and sees its files")
    ru = self.rusage
    usage = Usage(wall_s, ru.ru_utime, ru.ru_stime, ru.ru_maxrss * 1024)
    outcome, reason = self._classify(report, limits, ru.ru_utime + ru.ru_stime)
    return SandboxResult(outcome, self.proc.returncode, bytes(self.out["stdout"]), bytes(self.out["stderr"]),
                         self.truncated, usage, not net_error, self.uid, reason, tuple(notes))

  def _classify(self, report: dict, limits: Limits, cpu_s: float) -> tuple[Outcome, str]:
    code = self.proc.returncode
    if "exec_error" in report:
      return Outcome.INFRA_ERROR, f"could not exec: {report['exec_error']}"
    if not report:  # the launcher died before the exec; the program never ran
      return Outcome.INFRA_ERROR, f"the sandbox launcher failed (exit {code}): {_last_line(self.out['stderr'])}"
    if self.killed_for == "timeout":
      return Outcome.TIMEOUT, f"killed at the {limits.timeout_s} s wall-clock limit"
    if self.killed_for:
      return Outcome.LIMIT, f"killed: {self.killed_for}"
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
