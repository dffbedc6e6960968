"""Exact-answer math: the final answer of the model's solution against a reference.

Task records are `{"prompt": str | chat messages, "answer": str}` (GSM8K,
MATH, and the `ptx.data.arithmetic.ArithmeticTask` records alike). The
answer is found by `ptx.verifiers.math_answer.extract_answer` and compared
by `ptx.verifiers.math_equal.equivalent`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ptx.verifiers import math_answer, math_equal
from ptx.envs.base import Outcome, SingleTurn, Step, field, prompt_text
from ptx.verifiers.sympy_check import SymbolicChecker


@dataclasses.dataclass(frozen=True)
class ExactAnswerEnv:
  """Single-turn math with a verifiable final answer.

  Attributes:
    instruction: appended to each prompt (e.g. ask for `\\boxed{}`); "" for none.
    checker: symbolic worker pool; None for the process-wide one.
  """

  name: str = "exact_answer"
  max_turns: int = 1
  sandboxed: bool = False
  instruction: str = ""
  checker: SymbolicChecker | None = None

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks a `{"prompt", "answer"}` record's fields."""
    prompt_text(task, self.name)
    field(task, "answer", (str, int, float), self.name)

  def reset(self, task: Mapping[str, Any]) -> SingleTurn:
    """Starts an episode for a `{"prompt", "answer"}` record."""
    self.validate(task)
    reference = str(task["answer"])
    return SingleTurn(prompt_text(task, self.name) + self.instruction, lambda action: self._score(action, reference))

  def _score(self, action: str, reference: str) -> Step:
    answer = math_answer.extract_answer(action)
    if answer is None:
      return Step.final(Outcome.NO_ANSWER, "no final answer found")
    if math_equal.equivalent(answer, reference, checker=self.checker):
      return Step.final(Outcome.OK, f"{answer!r} equals {reference!r}")
    return Step.final(Outcome.WRONG, f"{answer!r} is not {reference!r}")
