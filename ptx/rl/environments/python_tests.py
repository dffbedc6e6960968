"""Python code against unit tests, run in the sandbox.

Task records are `{"prompt": str, "tests": str | list[str]}`: the tests are
Python statements (usually asserts, MBPP/HumanEval style) run after
`from solution import *`. The model's code is the last fenced code block of its
output (the whole output when it has none). The reward is 1.0 when the test
script exits 0; the outcome carries the sandbox's verdict otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from ptx.rl import sandbox
from ptx.rl.environments.base import Outcome, SingleTurn, Step, field, from_sandbox

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
  """Returns the last fenced code block of `text`, or all of it when there is none.

  Args:
    text: the model's output.

  Returns:
    Python source.
  """
  blocks = _FENCE.findall(text)
  return blocks[-1] if blocks else text


def _last_line(text: str) -> str:
  lines = [line for line in text.strip().splitlines() if line.strip()]
  return lines[-1][:200] if lines else ""


@dataclasses.dataclass(frozen=True)
class PythonTestsEnv:
  """Single-turn: the model writes code; the task's tests judge it in the sandbox.

  Attributes:
    python: the interpreter, looked up on the sandbox PATH.
    limits: the sandbox limits for one test run.
  """

  name: str = "python_tests"
  max_turns: int = 1
  python: str = "python3"
  limits: sandbox.Limits = sandbox.Limits(timeout_s=10.0, cpu_s=10, memory_bytes=1 << 30)

  def reset(self, task: Mapping[str, Any]) -> SingleTurn:
    """Starts an episode for a `{"prompt", "tests"}` record."""
    prompt = field(task, "prompt", str, self.name)
    tests = field(task, "tests", (str, list), self.name)
    script = "from solution import *\n\n" + (tests if isinstance(tests, str) else "\n".join(tests)) + "\n"
    return SingleTurn(prompt, lambda action: self._score(action, script))

  def _score(self, action: str, script: str) -> Step:
    code = extract_code(action)
    if not code.strip():
      return Step.final(Outcome.NO_ANSWER, "no code")
    # -E -s: ignore PYTHON* variables and user site; the script's folder stays on sys.path.
    result = sandbox.run([self.python, "-E", "-s", "test_solution.py"], limits=self.limits,
                         files={"solution.py": code, "test_solution.py": script})
    outcome = from_sandbox(result.outcome)
    if outcome == Outcome.OK:
      return Step.final(outcome, "all tests passed")
    return Step.final(outcome, f"{result.reason}: {_last_line(result.stderr_text)}".rstrip(": "))
