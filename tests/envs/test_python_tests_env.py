"""PythonTestsEnv: honest answers score 1, wrong ones 0, and the sandbox's verdicts map to outcomes."""

import dataclasses

import pytest
from episodes import one_step

from ptx.sandbox import run as sandbox
from ptx.envs import python_tests

# cpu_s well below timeout_s, so a busy loop meets the CPU limit first even on a loaded machine.
FAST = sandbox.Limits(timeout_s=20.0, cpu_s=1, memory_bytes=256 << 20)


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
  step = one_step(env, CODE_TASK, action)
  assert step.done and step.outcome == outcome, step.reason


def _score(task, code, env=CODE_ENV):
  return one_step(env, task, f"```python\n{code}\n```")


PARSE_TASK = {"prompt": "Write parse(s): int(s), ValueError('bad') otherwise.", "tests": [
    "try:\n  parse('x')\nexcept ValueError as e:\n  assert str(e) == 'bad'\nelse:\n  assert False",
    "try:\n  parse('')\nexcept KeyError:\n  assert False\nexcept Exception:\n  pass",
    "assert parse('3') == 3",
]}


@pytest.mark.parametrize("code,outcome", [
    ("def parse(s):\n  if not s.isdigit():\n    raise ValueError('bad')\n  return int(s)", "ok"),
    # Its own exception type is not the builtin ValueError the first test expects.
    (("class ValueErr(Exception):\n  pass\ndef parse(s):\n  if not s.isdigit():\n    raise ValueErr('bad')\n"
     "  return int(s)"), "wrong"),
    ("def parse(s):\n  if not s.isdigit():\n    raise ValueError('other')\n  return int(s)", "wrong"),
])
def test_solution_exceptions_arrive_as_builtin_types(code, outcome):
  step = _score(PARSE_TASK, code)
  assert step.outcome == outcome, step.reason


STACK_TASK = {"prompt": "Write a class Stack.", "tests": [
    ("s = Stack()\ns.push(1)\ns.push(2)\nassert len(s) == 2 and s.size == 2\nassert s.pop() == 2\n"
    "assert s.pop() == 1\nassert str(s) == 'Stack([])'"),
    "t = Stack()\nassert t is not s and t != s and s == s\nt.push(items=[3])\nassert t.peek() == [3]",
    "try:\n  bool(s)\nexcept TypeError as e:\n  assert 'not plain data' in str(e)\nelse:\n  assert False",
]}
STACK_CODE = """
class Stack:
  def __init__(self):
    self.items = []
  def push(self, items):
    self.items.append(items)
  def pop(self):
    return self.items.pop()
  def peek(self):
    return self.items[-1]
  @property
  def size(self):
    return len(self.items)
  def __len__(self):
    return len(self.items)
  def __str__(self):
    return f"Stack({self.items})"
"""


def test_class_based_tests_work_through_handles():
  step = _score(STACK_TASK, STACK_CODE)
  assert step.outcome == "ok", step.reason
  step = _score(STACK_TASK, STACK_CODE.replace("self.items.pop()", "self.items.pop(0)"))
  assert step.outcome == "wrong", step.reason


ALL_TASK = {"prompt": "Export only add.", "tests": [
    "assert add(1, 2) == 3", "assert _helper() == 7",
    "try:\n  sub\nexcept NameError:\n  pass\nelse:\n  assert False",
    "from solution import add as plus\nassert plus(2, 2) == 4",
]}


@pytest.mark.parametrize("code,outcome", [
    (("__all__ = ['add', '_helper']\ndef add(a, b):\n  return a + b\ndef sub(a, b):\n  return a - b\n"
     "def _helper():\n  return 7"), "ok"),
    ("def add(a, b):\n  return a + b\ndef sub(a, b):\n  return a - b\ndef _helper():\n  return 7", "wrong"),
    ("__all__ = ['add', 'missing']\ndef add(a, b):\n  return a + b", "wrong"),
])
def test_all_is_honoured(code, outcome):
  step = _score(ALL_TASK, code)
  assert step.outcome == outcome, step.reason


# Each assert fails under Python's own == and in: the grader's equality is strict.
STRICT_TASK = {"prompt": "Write ident(x).", "tests": [
    "assert ident(True) != 1", "assert ident(1) != 1.0", "assert ident((1,)) != [1]",
    "assert ident([1, (2.0, 'x')]) == [1, (2.0, 'x')]", "assert ident(float('nan')) == float('nan')",
    "assert ident({1: 'a'}) != {True: 'a'}", "assert ident({1, 2}) == {2, 1}", "assert ident({1}) != {1.0}",
    "assert 1 < ident(2) == 2 < 3", "assert not (1 == ident(1) == 1.0)", "assert ident(True) not in [1, 1.0]",
    "assert ident(1) in (1.0, 1)", "assert ident(True) not in {1: 'one'}", "assert ident(-0.0) == 0.0",
    "assert ident(b'x') != 'x'", "assert [ident(1)] != [True]", "assert ident(None) == None",
]}


def test_equality_is_strict_about_types():
  step = _score(STRICT_TASK, "def ident(x):\n  return x")
  assert step.outcome == "ok", step.reason


def test_a_string_of_tests_is_one_test():
  task = {"prompt": "Write add(a, b).", "tests": "def check(candidate):\n  assert candidate(1, 2) == 3\n"
                                                "  assert candidate(0, 0) == 0\n\ncheck(add)\n"}
  assert _score(task, "def add(a, b):\n  return a + b").outcome == "ok"
  step = _score(task, "def add(a, b):\n  return a * b + 1")
  assert step.outcome == "wrong" and "test 1 of 1" in step.reason, step.reason


@pytest.mark.parametrize("tests", [
    ["assert add(1, 2) == 3", "raise SystemExit(0)"],
    ["import os\nos._exit(0)"],
])
def test_a_test_that_exits_fails(tests):
  # os._exit in test code kills the grader before its verdict: never OK.
  step = _score({"prompt": "p", "tests": tests}, "def add(a, b):\n  return a + b")
  assert step.outcome != "ok" and step.reward == 0.0, step.reason


def test_a_test_that_catches_everything_still_fails_when_the_solution_is_gone():
  task = {"prompt": "p", "tests": ["try:\n  add(1, 2)\nexcept BaseException:\n  pass"]}
  step = _score(task, "import os\ndef add(a, b):\n  os._exit(0)")
  assert step.outcome == "wrong" and "ended" in step.reason, step.reason


def test_prints_in_tests_do_not_touch_the_verdict():
  task = {"prompt": "p", "tests": ["print('{\"passed\": 0}')\nassert add(1, 2) == 3", "print('x' * 100000)"]}
  assert _score(task, "def add(a, b):\n  return a + b").outcome == "ok"


def test_a_grader_that_cannot_run_is_an_infra_error():
  env = python_tests.PythonTestsEnv(python="no-such-python3", limits=FAST)
  step = _score(CODE_TASK, "def add(a, b):\n  return a + b", env)
  assert step.outcome == "infra_error" and step.reward == 0.0, step.reason


def test_malformed_tests_are_refused_at_reset():
  with pytest.raises(ValueError, match="test 2 is not valid Python"):
    CODE_ENV.reset({"prompt": "p", "tests": ["assert True", "assert ("]})
  with pytest.raises(ValueError, match="non-empty list of str"):
    CODE_ENV.reset({"prompt": "p", "tests": []})
