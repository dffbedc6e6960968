"""A multi-turn shell task: the model runs commands, then a check decides.

Task records are `{"prompt": str, "files": {path: content}, "check": str}`
with an optional `"max_turns": int` (at most the environment's). Each episode gets a sandbox workspace
holding `files` (the fixed initial state). Every action is one shell command,
the last fenced code block of the output or else the whole output, run with
`sh -c` in the workspace; its exit status and capped output are the next
observation. The action `DONE` (or running out of turns) ends the episode: the
task's `check` command runs in the workspace, and the reward is 1.0 when it
exits 0. Processes a command leaves behind are killed before the next turn.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from ptx.rl import sandbox
from ptx.rl.environments.base import Outcome, Step, field, from_sandbox

_FENCE = re.compile(r"```[ \t]*(?:bash|sh|shell|console)?[ \t]*\n(.*?)```", re.DOTALL)
_INSTRUCTIONS = ("\n\nYou are in a shell. Reply with one command per turn (a ```bash block or plain text); "
                 "you will see its exit status and output. Reply DONE when the task is complete.")
_OBSERVATION_CHARS = 2000  # of each command's output shown to the model


@dataclasses.dataclass
class ShellEpisode:
  """One attempt: a workspace, a turn budget and the check."""

  prompt: str
  check: str
  turns_left: int
  limits: sandbox.Limits
  workspace: sandbox.Workspace

  def step(self, action: str) -> Step:
    """Runs one command, or the check on DONE / the last turn."""
    blocks = _FENCE.findall(action)
    command = (blocks[-1] if blocks else action).strip()
    if command.upper() == "DONE":
      return self._judge()
    self.turns_left -= 1
    result = sandbox.run(["sh", "-c", command], limits=self.limits, workspace=self.workspace)
    if result.outcome == sandbox.Outcome.INFRA_ERROR:
      return Step.final(Outcome.INFRA_ERROR, result.reason)
    if self.turns_left == 0:
      return self._judge()
    output = (result.stdout_text + result.stderr_text)[-_OBSERVATION_CHARS:]
    return Step(observation=f"[exit {result.exit_code}] {output}")

  def _judge(self) -> Step:
    result = sandbox.run(["sh", "-c", self.check], limits=self.limits, workspace=self.workspace)
    if result.outcome == sandbox.Outcome.OK:
      return Step.final(Outcome.OK, "the check passed")
    if result.outcome == sandbox.Outcome.FAILED:
      return Step.final(Outcome.WRONG, f"the check failed ({result.reason})")
    return Step.final(from_sandbox(result.outcome), f"the check did not finish: {result.reason}")

  def close(self) -> None:
    """Kills leftover processes and deletes the workspace."""
    self.workspace.close()


@dataclasses.dataclass(frozen=True)
class ShellEnv:
  """Multi-turn shell tasks in a sandboxed working directory.

  Attributes:
    max_turns: commands allowed when the record sets none, and the most it may set.
    limits: sandbox limits for each command and for the check.
  """

  name: str = "shell"
  max_turns: int = 8
  limits: sandbox.Limits = sandbox.Limits(timeout_s=5.0, cpu_s=5)

  def reset(self, task: Mapping[str, Any]) -> ShellEpisode:
    """Starts an episode for a `{"prompt", "files", "check"}` record."""
    prompt = field(task, "prompt", str, self.name)
    files = field(task, "files", dict, self.name)
    check = field(task, "check", str, self.name)
    turns = int(task.get("max_turns", self.max_turns))
    if not 1 <= turns <= self.max_turns:
      raise ValueError(f"{self.name} task field 'max_turns' must be in 1..{self.max_turns}, got {turns}")
    return ShellEpisode(prompt + _INSTRUCTIONS, check, turns, self.limits, sandbox.Workspace(files))
