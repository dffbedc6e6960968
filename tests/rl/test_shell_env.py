"""ShellEnv: multi-turn shell tasks in a sandbox workspace."""

import os

import pytest

from ptx.rl import sandbox
from ptx.rl.environments import shell

# cpu_s well below timeout_s, so a busy loop meets the CPU limit first even on a loaded machine.
FAST = sandbox.Limits(timeout_s=20.0, cpu_s=1, memory_bytes=256 << 20)



SHELL_TASK = {"prompt": "Sort the numbers in data.txt into sorted.txt.", "files": {"data.txt": "3\n10\n2\n"},
              "check": "printf '2\\n3\\n10\\n' | cmp - sorted.txt", "max_turns": 3}
SHELL_ENV = shell.ShellEnv(limits=FAST)


def test_shell_task_solved_over_several_turns():
  episode = SHELL_ENV.reset(SHELL_TASK)
  path = episode.workspace.path
  try:
    assert "DONE" in episode.prompt
    first = episode.step("```bash\ncat data.txt\n```")
    assert not first.done and first.observation == "[exit 0] 3\n10\n2\n"
    assert episode.step("sort -n data.txt > sorted.txt").observation == "[exit 0] "
    final = episode.step("DONE")
  finally:
    episode.close()
  assert final.done and final.outcome == "ok" and final.reward == 1.0
  assert not path.exists()


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


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a private uid")
def test_shell_commands_leave_no_processes_behind():
  episode = SHELL_ENV.reset(SHELL_TASK)
  try:
    episode.step("sleep 100 & echo started")
    from ptx.rl import strays
    assert strays.live_pids(episode.workspace.uid) == []
  finally:
    episode.close()


def test_shell_task_turns_cannot_exceed_the_environment():
  with pytest.raises(ValueError, match="'max_turns' must be in 1..8"):
    shell.ShellEnv().reset({**SHELL_TASK, "max_turns": 9})
