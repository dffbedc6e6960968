"""Exact answers: the final answer of the model's reply against a reference, as math or as words.

Task records are `{"prompt": str | chat messages, "answer": str}` (GSM8K,
MATH, and the `ptx.data.arithmetic.ArithmeticTask` records alike). With
`match="math"` the answer is found by `ptx.verifiers.math_answer.extract_answer`
and compared by `ptx.verifiers.math_equal.equivalent`; with `match="text"` (a word
or phrase: "Paris") by `ptx.verifiers.text_answer`, normalised string equality,
and "answer" may also be a list of accepted aliases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from ptx.verifiers import math_answer, math_equal, text_answer
from ptx.envs.base import Outcome, SingleTurn, Step, field, prompt_text
from ptx.verifiers.sympy_check import SymbolicChecker


MATCHES = ("math", "text")


@dataclasses.dataclass(frozen=True)
class ExactAnswerEnv:
  """Single-turn question with a verifiable final answer.

  Attributes:
    instruction: appended to each prompt (e.g. ask for `\\boxed{}`); "" for none.
    checker: symbolic worker pool; None for the process-wide one.
    match: "math" (the stated answer or the last number, symbolically equal to the reference) or "text" (the
      stated answer or the last line, equal to the reference or one of its aliases once normalised).
  """

  name: str = "exact_answer"
  max_turns: int = 1
  sandboxed: bool = False
  instruction: str = ""
  checker: SymbolicChecker | None = None
  match: Literal["math", "text"] = "math"

  def __post_init__(self):
    if self.match not in MATCHES:
      raise ValueError(f"ExactAnswerEnv.match must be one of {MATCHES}, got {self.match!r}")

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks a `{"prompt", "answer"}` record's fields."""
    self._references(task)

  def reset(self, task: Mapping[str, Any]) -> SingleTurn:
    """Starts an episode for a `{"prompt", "answer"}` record."""
    references = self._references(task)
    return SingleTurn(prompt_text(task, self.name) + self.instruction, lambda action: self._score(action, references))

  def _references(self, task: Mapping[str, Any]) -> tuple[str, ...]:
    """The record's accepted answers, its fields checked (aliases, a list of str, in text mode only)."""
    prompt_text(task, self.name)
    if self.match == "math":
      return (str(field(task, "answer", (str, int, float), self.name)),)
    answer = field(task, "answer", (str, int, float, list), self.name)
    aliases = answer if isinstance(answer, list) else [answer]
    if not aliases or not all(isinstance(a, (str, int, float)) and text_answer.normalize(str(a)) for a in aliases):
      raise ValueError(f"{self.name} task field 'answer' must be a str or a non-empty list of str, each with a "
                       f"word left once normalised (match='text'), got {answer!r}")
    return tuple(str(a) for a in aliases)

  def _score(self, action: str, references: tuple[str, ...]) -> Step:
    if self.match == "text":
      answer = text_answer.extract(action)
      if answer is None:
        return Step.final(Outcome.NO_ANSWER, "no answer found")
      if text_answer.matches(answer, references):
        return Step.final(Outcome.OK, f"{answer!r} matches {references[0]!r}")
      return Step.final(Outcome.WRONG, f"{answer!r} is not {' or '.join(map(repr, references[:3]))}")
    answer = math_answer.extract_answer(action)
    if answer is None:
      return Step.final(Outcome.NO_ANSWER, "no final answer found")
    if math_equal.equivalent(answer, references[0], checker=self.checker):
      return Step.final(Outcome.OK, f"{answer!r} equals {references[0]!r}")
    return Step.final(Outcome.WRONG, f"{answer!r} is not {references[0]!r}")
