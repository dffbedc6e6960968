"""Symbolic equality with sympy, under a timeout that works from any thread.

A Python thread cannot be stopped, and `signal.alarm` works only in the main
thread and fights every other user of SIGALRM. So sympy runs in worker
processes (`sympy_worker.py`), and a comparison that overruns its timeout
kills its worker; the next call starts a fresh one. `SymbolicChecker` is
thread-safe: each call borrows an idle worker, up to `workers` at once.
"""

from __future__ import annotations

import atexit
import json
import pathlib
import select
import subprocess
import sys
import threading

_WORKER = str(pathlib.Path(__file__).with_name("inside") / "sympy_worker.py")
_STARTUP_S = 30.0  # importing sympy on a loaded machine; counted once per worker


class SymbolicChecker:
  """Compares sympy expression texts in killable worker processes.

  Args:
    workers: most comparisons running at once.
    timeout_s: seconds one comparison may take before its worker is killed.
    memory_bytes: address-space limit of each worker.
  """

  def __init__(self, workers: int = 1, timeout_s: float = 5.0, memory_bytes: int = 2 << 30):
    if workers < 1:
      raise ValueError(f"SymbolicChecker.workers must be >= 1, got {workers}")
    if timeout_s <= 0:
      raise ValueError(f"SymbolicChecker.timeout_s must be > 0, got {timeout_s}")
    self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
    self.timeouts = 0  # comparisons abandoned at the timeout
    self._slots = threading.BoundedSemaphore(workers)
    self._lock = threading.Lock()
    self._idle: list[subprocess.Popen] = []
    self._all: set[subprocess.Popen] = set()

  def equal(self, a: str, b: str) -> bool | None:
    """Returns whether a == b symbolically; None on a timeout or a parse failure.

    Args:
      a: a sympy expression text, already checked by `ptx.verifiers.latex`.
      b: likewise.

    Returns:
      True, False, or None when it could not be decided.
    """
    with self._slots:
      with self._lock:
        worker = self._idle.pop() if self._idle else None
      fresh = worker is None
      if fresh:
        worker = self._start()
      try:
        worker.stdin.write(json.dumps([a, b]) + "\n")
        worker.stdin.flush()
      except BrokenPipeError:  # it died while idle (killed from outside)
        self._kill(worker)
        return None
      timeout = self.timeout_s + (_STARTUP_S if fresh else 0.0)
      ready, _, _ = select.select([worker.stdout], [], [], timeout)
      line = worker.stdout.readline() if ready else ""
      if not line:
        self.timeouts += bool(not ready)
        self._kill(worker)
        return None
      with self._lock:
        self._idle.append(worker)
      return json.loads(line)

  def close(self) -> None:
    """Stops every worker."""
    with self._lock:
      workers, self._idle = list(self._all), []
    for worker in workers:
      self._kill(worker)

  def _start(self) -> subprocess.Popen:
    worker = subprocess.Popen([sys.executable, "-I", _WORKER, str(self.memory_bytes)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
    with self._lock:
      self._all.add(worker)
    return worker

  def _kill(self, worker: subprocess.Popen) -> None:
    worker.kill()
    worker.wait()
    for pipe in (worker.stdin, worker.stdout):
      pipe.close()
    with self._lock:
      self._all.discard(worker)


_default: SymbolicChecker | None = None
_default_lock = threading.Lock()


def default_checker() -> SymbolicChecker:
  """Returns the process-wide checker (two workers, 5 s), started on first use."""
  global _default
  with _default_lock:
    if _default is None:
      _default = SymbolicChecker(workers=2)
      atexit.register(_default.close)
    return _default
