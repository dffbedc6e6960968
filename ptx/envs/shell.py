"""A multi-turn shell task: the model runs commands, then a check it cannot reach decides.

Task records are `{"prompt": str, "files": {path: content}, "check": str}`
(the prompt may be chat messages of one user turn, `ptx.envs.base.user_turn`)
with optional `"check_files": {path: content}`, `"max_turns": int` (at most
the environment's) and `"setup": str`. Each episode gets a sandbox workspace
holding the task's fixed initial state: `files`, after `setup` (a command run
once on them in the sandbox, which must be deterministic) when there is one.
Workspaces come from the environment's warm pool when it has one
(`ptx.envs.warm_pool`: prepared ahead, checked against the state's digest),
else are prepared when the episode's first command needs one; a workspace
that cannot be prepared ends the episode as an infrastructure error. Every action is one shell command, the last
fenced code block of the output or else the whole output, run with `sh -c`
in the workspace; its exit status and capped output are the next
observation. Processes a command leaves behind are killed when it ends. The
action `DONE` (or running out of turns) ends the episode and the check
decides: the reward is 1.0 when it exits 0.

Where it runs. A command is a pure function, `run_command`: (command,
workspace snapshot) -> (what it did, the new snapshot), and the check is
another, `judge`. By default both run in the calling thread (an episode's
host thread). With `executor` (`ptx.scheduling.executors`; a `RayExecutor`: the CPU
nodes of a Ray cluster, each run in the OS sandbox of its node) each is a job
of the environment's `ptx.scheduling.offload.Offload`: its concurrency limit, a
timeout for jobs lost without word, retries of infrastructure faults (a node
that dies under a command: the command runs again elsewhere, from the same
snapshot, so it counts once). Each command keeps the snapshot it makes where
it ran (Ray's object store: a large one stays on its node, and the next
command reads it there, not through the trainer). What cannot be redone (a
large snapshot lost with its node, retries spent) ends the episode as
`infra_error`, never as the model's failure; the same episode ends with the
same observations, rewards and outcome on either side.

What the model cannot reach:
- `check_files` (a check script, expected outputs) are never in the
  workspace while the model acts. The check runs in a separate sandbox on a
  copy of the final workspace, with them under a directory whose random name
  is in `$CHECK_DIR`: the model could not have guessed it to plant a link.
  A task whose check names a file of `files` (a word of the command, "./"
  aside: `sh check.sh`) is refused at reset, since the model could rewrite
  that file; it belongs in `check_files`.
- The check sees the workspace without the model's links that point outside
  it (to /dev/stdin, /proc, a guessed path): a link `out.txt -> /dev/stdin`
  would otherwise make `cmp - out.txt` compare its input with itself.
- The check's environment is clean: the sandbox PATH (system directories
  only), a fresh HOME and /tmp, PYTHONSAFEPATH and PYTHONNOUSERSITE (a
  planted `json.py`, `sitecustomize.py` or `usercustomize.py` is not
  imported), no shell start-up file; no process of the model's survives.
What it can: a check that runs the model's programs runs them with the check
files readable (the same sandbox); such a task must compare their output
against what it cannot learn from those files alone, and a check that holds
expected values in memory while the model's code runs must make itself
undumpable (`prctl(PR_SET_DUMPABLE, 0)`), or that code can read them through
`/proc/PPID/mem` (`ptx.envs.terminal`'s check does both).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

from ptx.scheduling import offload, scheduler

from ptx.sandbox import run as sandbox

from ptx.envs import warm_pool
from ptx.envs.base import Outcome, Step, field, from_sandbox, user_turn
from ptx.scheduling.executors import Executor

_FENCE = re.compile(r"```[ \t]*(?:bash|sh|shell|console)?[ \t]*\n(.*?)```", re.DOTALL)
_INSTRUCTIONS = ("\n\nYou are in a shell. Reply with one command per turn (a ```bash block or plain text); "
                 "you will see its exit status and output. Reply DONE when the task is complete.")
_OBSERVATION_CHARS = 2000  # of each command's output shown to the model
_WORD = re.compile(r"[^\s;&|()<>=`'\"]+")  # a word of a shell command, near enough to find the files it names
# Start-up a check must not take from the workspace (Python 3.11 reads both).
_CHECK_ENV = {"PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1"}


@dataclasses.dataclass(frozen=True)
class Ran:
  """What one command did, as far as the model is shown."""

  exit_code: int | None
  output: str  # the end of its stdout, then its stderr
  stopped: bool  # the sandbox stopped it (time, a signal, a limit): a tool error


def run_command(command: str, limits: sandbox.Limits, snapshot: bytes) -> tuple[Ran, bytes]:
  """Runs one `sh -c` command in the sandbox on a workspace's snapshot (a pure function: a job anywhere).

  Args:
    command: the shell command.
    limits: what the run may use.
    snapshot: the workspace before (`ptx.sandbox.inside.workspace` bytes).

  Returns:
    (what it did, the workspace after).

  Raises:
    scheduler.InfraError: the sandbox failed (not the command).
  """
  argv = ["sh", "-c", command]
  if problem := sandbox.argv_problem(argv):  # what the model wrote cannot be a command: its failure, not ours
    return Ran(None, f"the command was not run: it {problem}", stopped=True), snapshot
  workspace = sandbox.Workspace()
  workspace.snapshot = snapshot
  result = sandbox.run(argv, limits=limits, workspace=workspace)
  if result.outcome == sandbox.Outcome.INFRA_ERROR:
    raise scheduler.InfraError(result.reason)
  # A command that exits nonzero ran; one the sandbox stopped (time, a signal, a limit) counts as a tool error.
  output = (result.stdout_text + result.stderr_text)[-_OBSERVATION_CHARS:]
  ran = Ran(result.exit_code, output, stopped=result.outcome not in (sandbox.Outcome.OK, sandbox.Outcome.FAILED))
  return ran, workspace.snapshot


def judge(check: str, check_files: Mapping[str, str], limits: sandbox.Limits, snapshot: bytes) -> Step:
  """Runs the check on a copy of a final workspace (a pure function: a job anywhere); see the module docstring.

  Args:
    check: the check's shell command.
    check_files: what it reads, put under a random `$CHECK_DIR`.
    limits: what the run may use (the disk doubled, for the check files).
    snapshot: the final workspace.

  Returns:
    The final Step: OK when the check exits 0.
  """
  secret = f".check-{secrets.token_hex(8)}"
  workspace = sandbox.Workspace()
  workspace.snapshot = snapshot
  with workspace.copy(keep_outside_links=False) as judged:
    # Room for the check files on top of what the model left, so no workspace can make the check fail to start.
    room = dataclasses.replace(limits, disk_bytes=2 * limits.disk_bytes)
    # CHECK_DIR from $PWD: the workspace's path differs between backends.
    result = sandbox.run(["sh", "-c", f'CHECK_DIR="$PWD/{secret}"; export CHECK_DIR\n{check}'],
                         limits=room, workspace=judged, env=_CHECK_ENV,
                         files={f"{secret}/{name}": content for name, content in check_files.items()})
  if result.outcome == sandbox.Outcome.OK:
    return Step.final(Outcome.OK, "the check passed")
  if result.outcome == sandbox.Outcome.FAILED:
    return Step.final(Outcome.WRONG, f"the check failed ({result.reason})")
  return Step.final(from_sandbox(result.outcome), f"the check did not finish: {result.reason}")


@dataclasses.dataclass
class ShellEpisode:
  """One attempt: a workspace, a turn budget and the check; commands and check run through `calls`."""

  prompt: str
  check: str
  check_files: Mapping[str, str]
  turns_left: int
  limits: sandbox.Limits
  lease: warm_pool.Lease
  calls: offload.Offload
  # The workspace now: bytes, or a handle where the executor keeps them (None: the lease's, not yet opened).
  _snapshot: Any = dataclasses.field(default=None, init=False, repr=False)

  @property
  def workspace(self) -> sandbox.Workspace:
    """A copy of the episode's workspace as it is now (waits for its preparation the first time)."""
    workspace = sandbox.Workspace()
    workspace.snapshot = self.calls.fetch(self._current())
    return workspace

  def step(self, action: str) -> Step:
    """Runs one command, or the check on DONE / the last turn."""
    try:
      self._current()
    except scheduler.InfraError as e:
      return Step.final(Outcome.INFRA_ERROR, f"no workspace: {e}")
    blocks = _FENCE.findall(action)
    command = (blocks[-1] if blocks else action).strip()
    if command.upper() == "DONE":
      return self._judge()
    self.turns_left -= 1
    try:
      ran, self._snapshot = self.calls.call(functools.partial(run_command, command, self.limits), self._current(),
                                            keep=True)
    except scheduler.InfraError as e:
      return Step.final(Outcome.INFRA_ERROR, str(e))
    counts = {"tool_calls": 1, "tool_errors": int(ran.stopped)}
    if self.turns_left == 0:
      return dataclasses.replace(self._judge(), **counts)
    return Step(observation=f"[exit {ran.exit_code}] {ran.output}", **counts)

  def _current(self) -> Any:
    """The workspace's snapshot (or its handle); the first time, the lease's (raises InfraError without one)."""
    if self._snapshot is None:
      self._snapshot = self.lease.workspace().snapshot
    return self._snapshot

  def _judge(self) -> Step:
    try:
      return self.calls.call(functools.partial(judge, self.check, self.check_files, self.limits), self._current())
    except scheduler.InfraError as e:
      return Step.final(Outcome.INFRA_ERROR, str(e))

  def close(self) -> None:
    """Drops the workspace (or its claim on one being prepared)."""
    self.lease.close()
    self._snapshot = b""


def _files(task: Mapping[str, Any], name: str, env: str) -> dict[str, str | bytes]:
  """task[name] ({} when "check_files" is absent): relative path -> content; else a ValueError naming the field."""
  files = field(task, name, dict, env) if name in task or name == "files" else {}
  if bad := [path for path, text in files.items() if not isinstance(text, (str, bytes))]:
    raise ValueError(f"{env} task field {name!r} must map paths to text; {bad[0]!r} is {type(files[bad[0]]).__name__}")
  return files


@dataclasses.dataclass(frozen=True)
class ShellEnv:
  """Multi-turn shell tasks in a sandboxed working directory.

  Attributes:
    max_turns: commands allowed when the record sets none, and the most it may set.
    limits: sandbox limits for each command and for the check.
    pool: prepares workspaces ahead (`expect`); None: each episode prepares its own.
    executor: where commands, checks and (without a pool) set-ups run, as jobs (`ptx.scheduling.executors`: a Ray
      cluster's CPU nodes, each in the OS sandbox of its node); None: in the calling thread, in this process.
    concurrency: with an executor, jobs running at once (at most the task slots its nodes offer).
    job_timeout_s: with an executor, seconds one job may take there, queueing included, before it counts as an
      infrastructure fault (a job lost without word); None: no limit. A command's own limit is `limits.timeout_s`.
  """

  name: str = "shell"
  max_turns: int = 8
  limits: sandbox.Limits = sandbox.Limits(timeout_s=5.0, cpu_s=5)
  sandboxed: bool = True
  pool: warm_pool.WarmPool | None = None
  executor: Executor | None = None
  concurrency: int = 32
  job_timeout_s: float | None = None

  def __post_init__(self):
    if self.concurrency < 1:
      raise ValueError(f"ShellEnv.concurrency must be >= 1, got {self.concurrency}")
    if self.job_timeout_s is not None and self.job_timeout_s <= 0:
      raise ValueError(f"ShellEnv.job_timeout_s must be > 0 or None, got {self.job_timeout_s}")
    # One runner for every episode: its scheduler bounds the jobs of all of them (it starts at the first job).
    object.__setattr__(self, "_calls", offload.Offload(self.executor, concurrency=self.concurrency,
                                                       timeout_s=self.job_timeout_s))

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks a `{"prompt", "files", "check"}` record's fields (optional "check_files", "max_turns", "setup"); the
    set-up and the check are not run."""
    self._checked(task)

  def reset(self, task: Mapping[str, Any]) -> ShellEpisode:
    """Starts an episode for a `{"prompt", "files", "check"}` record (optional "check_files", "max_turns")."""
    turns, state = self._checked(task)
    if self.executor is None:
      sandbox.backend()  # refuses here, naming the fix, when no sandbox works on this host (else: on the nodes)
    lease = self.pool.checkout(state) if self.pool is not None else warm_pool.Lease.inline(state, calls=self._calls)
    return ShellEpisode(user_turn(task, self.name) + _INSTRUCTIONS, task["check"], task.get("check_files", {}), turns,
                        self.limits, lease, self._calls)

  def first_prompt(self, task: Mapping[str, Any]) -> str:
    """The text of an episode's first prompt, found without a workspace (`reset` claims one from the pool)."""
    self._checked(task)
    return user_turn(task, self.name) + _INSTRUCTIONS

  def _checked(self, task: Mapping[str, Any]) -> tuple[int, warm_pool.InitialState]:
    """(the episode's turns, its initial state) of a record whose fields pass; else a ValueError naming the field."""
    user_turn(task, self.name)
    check = field(task, "check", str, self.name)
    _files(task, "check_files", self.name)
    words = {word.removeprefix("./") for word in _WORD.findall(check)}
    if named := sorted(words & set(_files(task, "files", self.name))):
      raise ValueError(f"{self.name} task field 'check' names {named[0]!r}, which 'files' puts in the workspace, where "
                       f"the model can rewrite it: move it to 'check_files' and name it \"$CHECK_DIR/{named[0]}\"")
    turns = task.get("max_turns", self.max_turns)
    if type(turns) is not int or not 1 <= turns <= self.max_turns:
      raise ValueError(f"{self.name} task field 'max_turns' must be in 1..{self.max_turns}, got {turns!r}")
    return turns, self.initial_state(task)

  def initial_state(self, task: Mapping[str, Any]) -> warm_pool.InitialState:
    """Where an episode of `task` starts: its files, after its set-up."""
    setup = task.get("setup", "")
    if not isinstance(setup, str):
      raise ValueError(f"{self.name} task field 'setup' must be a str, got {type(setup).__name__}")
    try:
      return warm_pool.InitialState.of(_files(task, "files", self.name), setup)
    except ValueError as e:  # a name that leaves the workspace
      raise ValueError(f"{self.name} task field 'files': {e}") from None

  def expect(self, tasks: Iterable[Mapping[str, Any]], samples: int = 1) -> None:
    """Has the pool prepare `samples` workspaces of each task ahead (nothing without a pool)."""
    if self.pool is not None:
      self.pool.expect([state for task in tasks for state in [self.initial_state(task)] * samples])
