"""A seeded, unlimited multi-digit arithmetic task with exact answers.

Task `i` of a seed is a pure function of (seed, i), so any index can be read
in any order (a random-access source for shuffling and exact resume), and the
same task generator feeds SFT demonstrations and verifiable RL prompts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """Problems "a op b=" with operands of 1..`max_digits` digits.

  Attributes:
    seed: selects the stream of problems.
    max_digits: operands have 1..max_digits decimal digits.
    ops: operators drawn uniformly, from "+", "-" and "*".
  """

  seed: int = 0
  max_digits: int = 2
  ops: str = "+"

  def __post_init__(self):
    if self.max_digits < 1:
      raise ValueError(f"ArithmeticTask.max_digits must be >= 1, got {self.max_digits}")
    bad = set(self.ops) - set(_OPS)
    if not self.ops or bad:
      raise ValueError(f"ArithmeticTask.ops must use {sorted(_OPS)}, got {self.ops!r}")

  def __getitem__(self, index: int) -> dict[str, str]:
    """Returns {"prompt": "12+34=", "answer": "46"} for problem `index`."""
    if index < 0:
      raise IndexError(f"ArithmeticTask index must be >= 0, got {index}")
    rng = np.random.default_rng([self.seed, index])
    a, b = (int(rng.integers(0, 10 ** int(rng.integers(1, self.max_digits + 1)))) for _ in range(2))
    op = self.ops[int(rng.integers(len(self.ops)))]
    return {"prompt": f"{a}{op}{b}=", "answer": str(_OPS[op](a, b))}
