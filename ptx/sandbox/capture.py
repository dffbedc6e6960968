"""The host's side of one sandbox run: feed stdin, read capped output, enforce the deadline, classify.

`Capture` watches the launched process (bwrap, or the rlimits backend's
launcher) with one selector: it feeds stdin, keeps at most `output_bytes` of
each stream (printing more kills the run), kills at the host's deadline,
follows the sandbox's PID 1 through a pidfd when bwrap names it, and turns
the launcher's report and what it saw into a `SandboxResult`.
"""

from __future__ import annotations

import errno
import json
import os
import select
import selectors
import signal
import subprocess
import time

from ptx.sandbox.result import Backend, Limits, Outcome, SandboxResult, Usage

# Python's own messages when an rlimit stops it (it ignores SIGXFSZ).
_LIMIT_MESSAGES = (b"MemoryError", b"[Errno 12] Cannot allocate memory", b"[Errno 27] File too large",
                   b"[Errno 11] Resource temporarily unavailable", b"[Errno 24] Too many open files",
                   b"[Errno 28] No space left on device")
_DRAIN_S = 0.5  # how long to wait for pipe EOF after the program exits
# Packing's time past the run's limit, which counts unpacking too: a program that used all its time still keeps
# its workspace when packing is quick, and no workspace stretches a run past its limit plus this.
PACK_S = 2.0
# The host's own deadline past the run's: PID 1 inside enforces the timeout and
# then packs the workspace (within PACK_S); this only catches a sandbox that stopped answering.
BACKSTOP_S = 10.0


class Capture:
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
      self.inner_survived = not select.select([self.inner], [], [], BACKSTOP_S)[0]
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
    if report.get("exit") is None:  # PID 1 died after the fork: only the program can have brought that about
      return Outcome.CRASHED, "the sandbox's first process ended without a report"
    return classify_exit(report, bytes(self.out["stderr"]), limits)


def classify_exit(report: dict, stderr: bytes, limits: Limits) -> tuple[Outcome, str]:
  """How a program that started and was reaped ended, from its report and its standard error.

  Args:
    report: "exit" (the wait status as Python's exit code), "killed" ("timeout"
      or "memory" when the watcher killed it), optionally "pack_error" and CPU
      seconds ("cpu_user_s", "cpu_system_s").
    stderr: what it printed there (its tail names the rlimit that stopped Python).
    limits: the run's limits, for the reason.

  Returns:
    The outcome and a one-line reason.
  """
  code = report["exit"]
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
  tail = stderr[-4096:]
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
