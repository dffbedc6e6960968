"""ptx.envs: math, arithmetic, countdown and the outcome labels (code and shell: files of their own)."""


import pytest
from episodes import one_step

from ptx.data.arithmetic import ArithmeticTask
from ptx.sandbox import run as sandbox
from ptx.envs import base, countdown, exact_answer, python_tests

@pytest.mark.parametrize("action,outcome", [
    (r"The area is $\boxed{\frac{1}{2}}$.", "ok"), ("so we get\n#### 0.5", "ok"), (r"\boxed{0.6}", "wrong"),
    ("I cannot solve this.", "no_answer"),
])
def test_exact_answer(action, outcome):
  step = one_step(exact_answer.ExactAnswerEnv(), {"prompt": "Half of 1?", "answer": "1/2"}, action)
  assert step.done and step.outcome == outcome and step.reward == (outcome == "ok")
  assert step.reason


def test_arithmetic_records_from_the_data_generator():
  env = exact_answer.ExactAnswerEnv()
  tasks = ArithmeticTask(seed=3, max_digits=3, ops="+-*")
  for i in range(20):
    task = tasks[i]
    assert one_step(env, task, task["prompt"] + task["answer"]).outcome == "ok"
    assert one_step(env, task, task["prompt"] + str(int(task["answer"]) + 1)).outcome == "wrong"


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
    assert one_step(env, task, f"<answer>{task['solution']}</answer>").outcome == "ok", task
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


def test_outcome_labels_map_from_the_sandbox():
  assert base.from_sandbox(sandbox.Outcome.FAILED) == base.Outcome.WRONG
  for label in ("ok", "timeout", "crashed", "limit", "infra_error"):
    assert base.from_sandbox(sandbox.Outcome(label)) == label


