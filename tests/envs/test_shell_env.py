"""ShellEnv: multi-turn shell tasks in a sandbox workspace."""

import dataclasses
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


@pytest.mark.parametrize("command", ["echo a\0b > sorted.txt", "echo " + "x" * 70_000 + " > sorted.txt", "echo \ud800"],
                         ids=["a NUL byte", "over 64 KiB", "a lone surrogate"])
def test_a_command_no_shell_could_receive_is_the_policys_failure(command):
  """What the model wrote cannot be an argument of `sh -c`: a failed command it is shown, and a reward of 0."""
  episode = SHELL_ENV.reset({**SHELL_TASK, "max_turns": 2})
  try:
    step = episode.step(command)
    assert not step.done and step.tool_errors == 1 and "was not run" in step.observation, step
    final = episode.step(command)  # the last turn: the check decides
  finally:
    episode.close()
  assert final.done and final.outcome == "wrong" and final.reward == 0.0, final


# Empty files under 250-byte names 16 levels deep: about 8 MB of snapshot in no page of the workspace's tmpfs.
_LONG_NAMES = "d=$(printf %0250d 0); for i in $(seq 16); do mkdir $d; cd $d; done; seq 2000 | xargs touch"


def test_a_command_that_takes_the_workspace_past_its_cap_is_the_policys_failure():
  env = shell.ShellEnv(limits=dataclasses.replace(FAST, disk_bytes=2 << 20))
  episode = env.reset(SHELL_TASK)
  try:
    step = episode.step(_LONG_NAMES)
    assert not step.done and step.tool_errors == 1, step
    assert len(episode.workspace.snapshot) <= 2 << 20  # what the episode holds stays under the cap
    assert episode.workspace.files() == {"data.txt": b"3\n10\n2\n"}
  finally:
    episode.close()
