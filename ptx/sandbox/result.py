"""What a sandbox run may use and how it ended: the vocabulary `ptx.sandbox.run` speaks."""

from __future__ import annotations

import dataclasses
import enum


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


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one run may use."""

  timeout_s: float = 10.0  # wall clock, unpacking the workspace included; then every process of the run is killed
  cpu_s: int = 10  # CPU seconds per process (SIGXCPU, then SIGKILL a second later)
  memory_bytes: int = 1 << 30  # address space per process; under bwrap also the resident memory of the run
  file_bytes: int = 16 << 20  # largest file it may write
  disk_bytes: int = 64 << 20  # under bwrap the size of /work and of /tmp, each; the most a kept snapshot stores
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
