"""PythonTestsEnv: honest answers score 1, wrong ones 0, and the sandbox's verdicts map to outcomes."""

import dataclasses

import pytest

from ptx.rl import sandbox
from ptx.rl.environments import python_tests

# cpu_s well below timeout_s, so a busy loop meets the CPU limit first even on a loaded machine.
FAST = sandbox.Limits(timeout_s=20.0, cpu_s=1, memory_bytes=256 << 20)


def _one(env, task, action):
  episode = env.reset(task)
  try:
    return episode.step(action)
  finally:
    episode.close()


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
