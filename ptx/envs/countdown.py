"""Countdown: reach a target with each given number exactly once, and its generator.

`CountdownTask(seed)[i]` is a pure function of (seed, i, split), like
`ptx.data.arithmetic.ArithmeticTask`: an unlimited, random-access stream of
solvable problems (the target is built from a random expression over the
numbers), drawn from one side of the train / held-out split
(`ptx.data.splits`, by the sorted numbers and the target). The model answers
with an expression inside `<answer></answer>`; it is parsed with `ast`
(integers, + - * / and parentheses only) and evaluated with exact fractions,
never with `eval`.
"""

from __future__ import annotations

import ast
import dataclasses
import fractions
import operator
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ptx.data import splits
from ptx.envs.base import Outcome, SingleTurn, Step, field, prompt_text

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_EXPR = 200  # characters; longer answers are not parsed


@dataclasses.dataclass(frozen=True)
class CountdownTask:
  """Seeded countdown problems.

  Attributes:
    seed: selects the stream of problems.
    count: numbers per problem.
    max_number: numbers are drawn from 1..max_number.
    max_target: targets are integers in 1..max_target.
    split: "train" (training streams) or "held_out" (evaluation sets).
  """

  seed: int = 0
  count: int = 4
  max_number: int = 50
  max_target: int = 1000
  split: str = "train"

  def __post_init__(self):
    for name, low in (("count", 2), ("max_number", 1), ("max_target", 1)):
      if getattr(self, name) < low:
        raise ValueError(f"CountdownTask.{name} must be >= {low}, got {getattr(self, name)}")
    splits.check("CountdownTask", self.split)

  def __getitem__(self, index: int) -> dict[str, Any]:
    """Returns {"prompt", "numbers", "target", "solution"} for problem `index`."""
    if index < 0:
      raise IndexError(f"CountdownTask index must be >= 0, got {index}")
    rng = np.random.default_rng([self.seed, index])

    def candidate() -> tuple[str, tuple[list[int], int, str]]:
      while True:
        numbers = [int(n) for n in rng.integers(1, self.max_number + 1, self.count)]
        value, text = _random_expression(numbers, rng)
        if value.denominator == 1 and 1 <= value <= self.max_target:
          return f"{sorted(numbers)}->{int(value)}", (numbers, int(value), text)

    numbers, target, text = splits.draw("CountdownTask", self.split, candidate)
    prompt = (f"Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
              "Use each number exactly once, with + - * / and parentheses. "
              "Give the expression inside <answer></answer>.")
    return {"prompt": prompt, "numbers": numbers, "target": target, "solution": text}


def _random_expression(numbers: list[int], rng: np.random.Generator) -> tuple[fractions.Fraction, str]:
  """Combines random pairs until one expression over all numbers is left."""
  pool = [(fractions.Fraction(n), str(n)) for n in numbers]
  while len(pool) > 1:
    i, j = rng.choice(len(pool), 2, replace=False)
    (a, ta), (b, tb) = pool[i], pool[j]
    op = "+-*/"[int(rng.integers(4))]
    if op == "/" and b == 0:
      op = "+"
    value = _APPLY[op](a, b)
    pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [(value, f"({ta} {op} {tb})")]
  value, text = pool[0]
  return value, text[1:-1] if text.startswith("(") else text


def _evaluate(node: ast.AST, used: list[int]) -> fractions.Fraction:
  """Evaluates an integer + - * / expression exactly; records the numbers it uses."""
  if isinstance(node, ast.Constant) and type(node.value) is int:
    used.append(node.value)
    return fractions.Fraction(node.value)
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    return _APPLY[_OPS[type(node.op)]](_evaluate(node.left, used), _evaluate(node.right, used))
  raise ValueError(f"only integers, + - * / and parentheses are allowed, got {type(node).__name__}")


def score(text: str, numbers: list[int], target: int) -> Step:
  """Scores a countdown answer.

  Args:
    text: the model's output, with the expression in `<answer></answer>`.
    numbers: the numbers to use, each exactly once.
    target: the value to reach.

  Returns:
    The final Step.
  """
  found = _ANSWER.findall(text)
  if not found:
    return Step.final(Outcome.NO_ANSWER, "no <answer></answer>")
  expression = found[-1].split("=")[0].strip()
  if not expression or len(expression) > _MAX_EXPR:
    return Step.final(Outcome.NO_ANSWER, f"empty or longer than {_MAX_EXPR} characters")
  used: list[int] = []
  try:
    value = _evaluate(ast.parse(expression, mode="eval").body, used)
  except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
    return Step.final(Outcome.WRONG, f"{expression!r} is not a valid expression: {e}")
  if sorted(used) != sorted(numbers):
    return Step.final(Outcome.WRONG, f"uses {sorted(used)}, not each of {sorted(numbers)} once")
  if value != target:
    return Step.final(Outcome.WRONG, f"{expression} = {value}, not {target}")
  return Step.final(Outcome.OK, f"{expression} = {target}")


@dataclasses.dataclass(frozen=True)
class CountdownEnv:
  """Single-turn countdown on `CountdownTask` records."""

  name: str = "countdown"
  max_turns: int = 1
  sandboxed: bool = False

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks a `{"prompt", "numbers", "target"}` record's fields."""
    prompt_text(task, self.name)
    if not all(isinstance(n, int) for n in field(task, "numbers", (list, tuple), self.name)):
      raise ValueError(f"{self.name} task field 'numbers' must hold ints only")
    field(task, "target", int, self.name)

  def reset(self, task: Mapping[str, Any]) -> SingleTurn:
    """Starts an episode for a `{"prompt", "numbers", "target"}` record."""
    self.validate(task)
    numbers, target = list(task["numbers"]), task["target"]
    return SingleTurn(prompt_text(task, self.name), lambda action: score(action, numbers, target))
