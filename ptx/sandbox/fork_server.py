"""A long-lived sandbox that runs one trusted Python program many times, each run a fork.

Every `sandbox.run` of a Python program pays for bwrap, the sandbox's PID 1
and the program's interpreter, most of a code sample's scoring (figures in
benchmarks/RESULTS.md). A program the caller trusts and runs once per sample
(the grader of `ptx.envs.python_tests`) needs a sandbox to keep
it from the host, not its runs from one another. `ForkServer` keeps one
sandbox per program, started on first use, in which `fork_loop.py`
has imported the program once; each `run` is a fork of that process, with
its own stdin, output, rlimits and deadline, and the caller's pipes as its
arguments.

Not for model-written code: the runs of one server share its sandbox (its
/tmp, its uid, its process namespace and its RLIMIT_NPROC count), so one run
could reach another; such code goes through `sandbox.run`.

A server is retired (it finishes what it is running, then exits) when its
sandbox's wall clock would run out before a new run could end, or when the
process chose another sandbox backend since it started; the next run starts a
fresh one. A server that dies takes its runs with it: they end as
INFRA_ERROR, saying so.
"""

from __future__ import annotations

import dataclasses
import marshal
import math
import os
import pathlib
import select
import socket
import threading
import time
from collections.abc import Mapping, Sequence

from ptx.sandbox import run as sandbox
from ptx.sandbox.capture import BACKSTOP_S, classify_exit
from ptx.sandbox.result import Limits, Outcome, SandboxResult, Usage

_LOOP = pathlib.Path(__file__).with_name("inside") / "fork_loop.py"
_LIFETIME_S = 4 * 3600.0  # of one server's sandbox; runs longer than this are refused
_OPEN_FILES = 4096  # of the loop: two per run in flight, plus each request's while it forks
_PROCESSES = 1024  # runs of one server in flight at once, with the processes they start
_REASON_WAIT_S = 2.0  # for a dead server's sandbox to report how it ended, to name it in its runs' reason


@dataclasses.dataclass
class _Server:
  """One server's sandbox: the socket requests go through, and the thread that waits for its end."""

  sock: socket.socket
  started: float
  backend: sandbox.Backend
  uid: int | None
  thread: threading.Thread | None = None
  ended: str | None = None  # how its sandbox ended, once it has, for the reason of the runs it lost

  def alive_for(self, seconds: float) -> bool:
    """Whether it is running and would still be when a run of `seconds` (and the backstop) ends."""
    left = self.started + _LIFETIME_S - time.monotonic()
    return self.ended is None and left > seconds + BACKSTOP_S  # its thread sets `ended` as it returns


class ForkServer:
  """Runs a trusted Python program in forks of one long-lived sandboxed process.

  Args:
    program: the file name of the program among `files`; it defines `main()`,
      which reads `sys.argv[1:]` (the descriptor numbers of `pass_fds`),
      stdin and writes stdout, as it would run as a script.
    files: relative path -> content of the server's workspace: the program
      and the modules it imports.
    python: the interpreter, looked up on the sandbox PATH.
  """

  def __init__(self, program: str, files: Mapping[str, str | bytes], *, python: str = "python3"):
    if program not in files:
      raise ValueError(f"ForkServer: program {program!r} is not among files {sorted(files)}")
    self.program, self.python = program, python
    self.files = {**files, _LOOP.name: _LOOP.read_text()}
    self._lock = threading.Lock()
    self._server: _Server | None = None

  def run(self, *, stdin: bytes | str = b"", pass_fds: Sequence[int] = (), limits: Limits = Limits()) -> SandboxResult:
    """Runs the program once, in a fork, and returns how it went; never raises for the program's sake.

    Args:
      stdin: the program's standard input.
      pass_fds: descriptors the program gets as 3, 4, ... (their numbers are
        its arguments); `run` owns them and closes them once they are sent.
      limits: the run's limits; `disk_bytes` is the server's, shared by its runs.

    Returns:
      The SandboxResult; its usage is the fork's own.

    Raises:
      ValueError: `limits.timeout_s` past a server's lifetime.
      SandboxUnavailable: no backend works here.
    """
    stdin = stdin.encode() if isinstance(stdin, str) else stdin
    request = {"timeout_s": limits.timeout_s,
               "limits": {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
                          "processes": limits.processes, "open_files": limits.open_files}}
    ours = []  # the host's descriptors of this run, closed on every path
    started = time.monotonic()
    try:
      try:
        if limits.timeout_s + BACKSTOP_S >= _LIFETIME_S / 2:
          raise ValueError(f"ForkServer.run: timeout_s {limits.timeout_s} is past half a server's {_LIFETIME_S} s life")
        ours += [sandbox.memory_file("fork-stdout"), sandbox.memory_file("fork-stderr"), *os.pipe()]
        out_fd, err_fd, status_r, status_w = ours
        in_fd = sandbox.memory_file("fork-stdin", stdin)
        try:
          server = self._send(marshal.dumps(request, 4), [in_fd, out_fd, err_fd, status_w, *pass_fds], limits)
        finally:
          os.close(in_fd)
      finally:
        for fd in (*pass_fds, *ours[3:]):
          os.close(fd)  # sent (the server holds its copies) or never to be
      report = _await(status_r, started + limits.timeout_s + BACKSTOP_S)
      if report is None:
        return self._lost(server, time.monotonic() - started)
      return _result(report, sandbox.read_memory_file(out_fd), sandbox.read_memory_file(err_fd), limits, server)
    finally:
      for fd in ours[:3]:
        os.close(fd)

  def close(self) -> None:
    """Retires the server: it finishes the runs in flight, then exits."""
    with self._lock:
      if self._server is not None:
        self._server.sock.close()
        self._server = None

  def _send(self, message: bytes, fds: list[int], limits: Limits) -> _Server:
    """Sends one request to a server that will outlive it, starting one when needed."""
    with self._lock:  # also keeps a retiring thread from closing the socket under a send
      server = self._server
      if server is None or not server.alive_for(limits.timeout_s) or server.backend != sandbox.backend():
        if server is not None:
          server.sock.close()  # the loop sees EOF: it finishes its runs and exits
          self._server = None
        server = self._server = self._start()
      try:
        socket.send_fds(server.sock, [message], fds)
      except OSError as e:  # it died since: the next run starts another
        server.sock.close()
        self._server = None
        server.ended = server.ended or f"its socket failed: {e}"
    return server

  def _start(self) -> _Server:
    workspace = sandbox.Workspace(self.files)
    host, inner = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = _Server(host, time.monotonic(), sandbox.backend(), workspace.uid)
    inner_fd = inner.detach()
    # The run's own limits stay the forks' (each sets its rlimits); these bound the loop and what its forks
    # share. Memory: the host's, so the sandbox's PID 1 does not sample it for hours.
    limits = Limits(timeout_s=_LIFETIME_S, cpu_s=math.ceil(_LIFETIME_S), memory_bytes=sandbox.host_memory_bytes(),
                    processes=_PROCESSES, open_files=_OPEN_FILES)
    argv = [self.python, "-I", "-S", _LOOP.name, str(inner_fd), self.program]

    def serve() -> None:
      try:
        ended = sandbox.run(argv, limits=limits, workspace=workspace, pass_fds=(inner_fd,))
        server.ended = f"{ended.reason}: {_last_line(ended.stderr_text)}".rstrip(": ")
      except BaseException as e:  # noqa: BLE001  (its runs end as INFRA_ERROR, with this as the reason)
        server.ended = f"it could not run: {e}"
      finally:
        workspace.close()

    # Its own thread: `sandbox.run` returns only when the server's sandbox has ended.
    server.thread = threading.Thread(target=serve, name=f"fork server {self.program}", daemon=True)
    try:
      server.thread.start()
    except BaseException:
      host.close()
      os.close(inner_fd)
      raise
    return server

  def _lost(self, server: _Server, wall_s: float) -> SandboxResult:
    """The result of a run whose server gave no report: it died, or stopped answering (then it is retired)."""
    server.thread.join(timeout=_REASON_WAIT_S)
    with self._lock:
      if self._server is server:
        server.sock.close()
        self._server = None
    why = f"the fork server ended ({server.ended})" if server.ended else "the fork server stopped answering"
    return SandboxResult(Outcome.INFRA_ERROR, None, b"", b"", False, Usage(wall_s, 0.0, 0.0, 0),
                         _isolated(server), server.uid, why, backend=str(server.backend))


def _await(status_r: int, deadline: float) -> dict | None:
  """The fork's report, once the server sends it; None when the server closed the pipe without one or timed out."""
  data = b""
  while (left := deadline - time.monotonic()) > 0 and select.select([status_r], [], [], left)[0]:
    chunk = os.read(status_r, 1 << 12)
    if not chunk:
      try:
        return marshal.loads(data)
      except (EOFError, ValueError, TypeError):
        return None
    data += chunk
  return None


def _result(report: dict, stdout: bytes, stderr: bytes, limits: Limits, server: _Server) -> SandboxResult:
  truncated = len(stdout) > limits.output_bytes or len(stderr) > limits.output_bytes
  if truncated:
    outcome, reason = Outcome.LIMIT, f"printed past the {limits.output_bytes}-byte output cap"
  else:
    outcome, reason = classify_exit(report, stderr, limits)
  usage = Usage(report["wall_s"], report["cpu_user_s"], report["cpu_system_s"], report["max_rss_bytes"])
  return SandboxResult(outcome, report["exit"], stdout[:limits.output_bytes], stderr[:limits.output_bytes],
                       truncated, usage, _isolated(server), server.uid, reason, ("a fork of a long-lived sandbox",),
                       str(server.backend))


def _isolated(server: _Server) -> bool:
  """Whether its runs are cut from the network: always under bwrap; the rlimits backend reports it only at the end."""
  return server.backend == sandbox.Backend.BWRAP


def _last_line(text: str) -> str:
  lines = text.strip().splitlines()
  return lines[-1][:200] if lines else ""

