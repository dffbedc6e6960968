"""ShellEnv: multi-turn shell tasks in a sandbox workspace."""

import os
import pathlib
import secrets

import pytest

from ptx.sandbox import run as sandbox
from ptx.envs import shell

# cpu_s well below timeout_s, so a busy loop meets the CPU limit first even on a loaded machine.
FAST = sandbox.Limits(timeout_s=20.0, cpu_s=1, memory_bytes=256 << 20)


SHELL_TASK = {"prompt": "Sort the numbers in data.txt into sorted.txt.", "files": {"data.txt": "3\n10\n2\n"},
              "check": "printf '2\\n3\\n10\\n' | cmp - sorted.txt", "max_turns": 3}
SHELL_ENV = shell.ShellEnv(limits=FAST)


def test_shell_task_solved_over_several_turns():
  episode = SHELL_ENV.reset(SHELL_TASK)
  try:
    assert "DONE" in episode.prompt
    first = episode.step("```bash\ncat data.txt\n```")
    assert not first.done and first.observation == "[exit 0] 3\n10\n2\n"
    assert episode.step("sort -n data.txt > sorted.txt").observation == "[exit 0] "
    final = episode.step("DONE")
  finally:
    episode.close()
  assert final.done and final.outcome == "ok" and final.reward == 1.0
  assert episode.workspace.files() == {}


def test_shell_task_wrong_and_out_of_turns():
  episode = SHELL_ENV.reset(SHELL_TASK)
  try:
    assert episode.step("sort data.txt > sorted.txt").observation == "[exit 0] "  # lexical: wrong order
    assert episode.step("sleep 100 &").observation.startswith("[exit 0]")
    final = episode.step("ls")  # the third and last command: then the check runs
  finally:
    episode.close()
  assert final.done and final.outcome == "wrong" and final.reward == 0.0


def test_shell_task_state_is_fixed_per_episode():
  first = SHELL_ENV.reset(SHELL_TASK)
  second = SHELL_ENV.reset(SHELL_TASK)
  try:
    first.step("rm data.txt")
    assert second.step("cat data.txt").observation == "[exit 0] 3\n10\n2\n"
  finally:
    first.close()
    second.close()


def _processes_with(marker: str) -> list[int]:
  """Pids anywhere on the host whose command line holds `marker`."""
  found = []
  for name in os.listdir("/proc"):
    try:
      if name.isdigit() and marker.encode() in pathlib.Path(f"/proc/{name}/cmdline").read_bytes():
        found.append(int(name))
    except OSError:
      pass  # it exited while we looked
  return found


def test_shell_commands_leave_no_processes_behind():
  marker = f"ptx-shell-leftover-{secrets.token_hex(4)}"
  episode = SHELL_ENV.reset(SHELL_TASK)
  try:
    step = episode.step(f"python3 -c 'import time; time.sleep(100)  # {marker}' & echo started")
    assert step.observation == "[exit 0] started\n"
    assert _processes_with(marker) == []
  finally:
    episode.close()


def test_shell_task_turns_cannot_exceed_the_environment():
  with pytest.raises(ValueError, match="'max_turns' must be in 1..8"):
    shell.ShellEnv().reset({**SHELL_TASK, "max_turns": 9})
