"""ptx.rl.environments: math, arithmetic, countdown, Python tests, the shell task."""

import dataclasses
import os

import pytest

from ptx.data.arithmetic import ArithmeticTask
from ptx.rl import sandbox
from ptx.rl.environments import base, countdown, exact_answer, python_tests, shell

# cpu_s well below timeout_s, so a busy loop meets the CPU limit first even on a loaded machine.
FAST = sandbox.Limits(timeout_s=20.0, cpu_s=1, memory_bytes=256 << 20)


def _one(env, task, action):
  episode = env.reset(task)
  try:
    return episode.step(action)
  finally:
    episode.close()


@pytest.mark.parametrize("action,outcome", [
    (r"The area is $\boxed{\frac{1}{2}}$.", "ok"), ("so we get\n#### 0.5", "ok"), (r"\boxed{0.6}", "wrong"),
    ("I cannot solve this.", "no_answer"),
])
def test_exact_answer(action, outcome):
  step = _one(exact_answer.ExactAnswerEnv(), {"prompt": "Half of 1?", "answer": "1/2"}, action)
  assert step.done and step.outcome == outcome and step.reward == (outcome == "ok")
  assert step.reason


def test_arithmetic_records_from_the_data_generator():
  env = exact_answer.ExactAnswerEnv()
  tasks = ArithmeticTask(seed=3, max_digits=3, ops="+-*")
  for i in range(20):
    task = tasks[i]
    assert _one(env, task, task["prompt"] + task["answer"]).outcome == "ok"
    assert _one(env, task, task["prompt"] + str(int(task["answer"]) + 1)).outcome == "wrong"


def test_missing_field_is_named():
  with pytest.raises(ValueError, match="'answer'"):
    exact_answer.ExactAnswerEnv().reset({"prompt": "1+1="})
  with pytest.raises(ValueError, match="'tests'"):
    python_tests.PythonTestsEnv().reset({"prompt": "p"})


def test_countdown_generator_is_seeded_random_access_and_solvable():
  tasks = countdown.CountdownTask(seed=7)
  assert tasks[5] == countdown.CountdownTask(seed=7)[5] != tasks[6]
  assert tasks[5] != countdown.CountdownTask(seed=8)[5]
  env = countdown.CountdownEnv()
  for i in range(200):
    task = tasks[i]
    assert len(task["numbers"]) == 4 and 1 <= task["target"] <= 1000
    assert _one(env, task, f"<answer>{task['solution']}</answer>").outcome == "ok", task
  with pytest.raises(ValueError, match="CountdownTask.count"):
    countdown.CountdownTask(count=1)


@pytest.mark.parametrize("answer,outcome,why", [
    ("<answer>(6 - 2) * 5 + 1</answer>", "ok", "= 21"),
    ("<answer>6 * 5 - 2 - 1 = 27</answer>", "wrong", "not 21"),
    ("<answer>6 * 5 - 2 - 1 - 1</answer>", "wrong", "once"),
    ("<answer>(6 - 2) * 5</answer>", "wrong", "once"),
    ("<answer>__import__('os').system('true')</answer>", "wrong", "allowed"),
    ("<answer>6 / (2 - 2) + 5 * 1</answer>", "wrong", "valid"),
    ("<answer>6 ** 2 - 5 - 1</answer>", "wrong", "allowed"),
    ("the answer is 21", "no_answer", "answer"),
])
def test_countdown_scoring(answer, outcome, why):
  step = countdown.score(answer, [6, 2, 5, 1], 21)
  assert step.outcome == outcome and why in step.reason, step.reason


CODE_TASK = {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
CODE_ENV = python_tests.PythonTestsEnv(limits=FAST)


@pytest.mark.parametrize("action,outcome", [
    ("Here:\n```python\ndef add(a, b):\n  return a + b\n```", "ok"),
    ("```python\ndef add(a, b):\n  return a - b\n```", "wrong"),
    ("def add(a, b) return", "wrong"),
    ("```python\ndef add(a, b):\n  while True: pass\n```", "limit"),
    ("```python\nimport time\ndef add(a, b):\n  time.sleep(100)\n```", "timeout"),
    ("```python\nimport os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n```", "crashed"),
    ("```python\n```", "no_answer"),
])
def test_python_tests(action, outcome):
  short = dataclasses.replace(FAST, timeout_s=1.0)
  env = python_tests.PythonTestsEnv(limits=short) if outcome == "timeout" else CODE_ENV
  step = _one(env, CODE_TASK, action)
  assert step.done and step.outcome == outcome, step.reason


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


def test_outcome_labels_map_from_the_sandbox():
  assert base.from_sandbox(sandbox.Outcome.FAILED) == base.Outcome.WRONG
  for label in ("ok", "timeout", "crashed", "limit", "infra_error"):
    assert base.from_sandbox(sandbox.Outcome(label)) == label


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
