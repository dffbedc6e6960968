"""A seeded, unlimited multi-digit arithmetic task with exact answers, split into train and held-out problems.

Task `i` of a seed is a pure function of (seed, i, split), so any index can be
read in any order (a random-access source for shuffling and exact resume),
and the same task generator feeds SFT demonstrations and verifiable RL
prompts. A task draws only problems of its `split` (`ptx.data.splits`, by
the problem's identity: its operands, in order for "+" and "*" since 3+5 and
5+3 are one fact), so a train stream and a held-out set never share one.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from ptx.data import splits

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_COMMUTATIVE = "+*"


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """Problems "a op b=" with operands of 1..`max_digits` digits, from one side of the split.

  Attributes:
    seed: selects the stream of problems.
    max_digits: operands have 1..max_digits decimal digits.
    ops: operators drawn uniformly, from "+", "-" and "*".
    split: "train" (training streams) or "held_out" (evaluation sets).
  """

  seed: int = 0
  max_digits: int = 2
  ops: str = "+"
  split: str = "train"

  def __post_init__(self):
    if self.max_digits < 1:
      raise ValueError(f"ArithmeticTask.max_digits must be >= 1, got {self.max_digits}")
    bad = set(self.ops) - set(_OPS)
    if not self.ops or bad:
      raise ValueError(f"ArithmeticTask.ops must use {sorted(_OPS)}, got {self.ops!r}")
    splits.check("ArithmeticTask", self.split)

  def __getitem__(self, index: int) -> dict[str, str]:
    """Returns {"prompt": "12+34=", "answer": "46"} for problem `index`."""
    if index < 0:
      raise IndexError(f"ArithmeticTask index must be >= 0, got {index}")
    rng = np.random.default_rng([self.seed, index])

    def candidate() -> tuple[str, tuple[int, str, int]]:
      a, b = (int(rng.integers(0, 10 ** int(rng.integers(1, self.max_digits + 1)))) for _ in range(2))
      op = self.ops[int(rng.integers(len(self.ops)))]
      return identity(a, op, b), (a, op, b)

    a, op, b = splits.draw("ArithmeticTask", self.split, candidate)
    return {"prompt": f"{a}{op}{b}=", "answer": str(_OPS[op](a, b))}

  def split_sizes(self) -> dict[str, int]:
    """How many of the task's distinct prompts each split holds (enumerates the space: small ones only)."""
    operands = range(10**self.max_digits)
    return splits.sizes(identity(a, op, b) for op in self.ops for a, b in itertools.product(operands, operands))


def identity(a: int, op: str, b: int) -> str:
  """The problem's canonical identity: "3+5" and "5+3" are one problem, "5-3" and "3-5" two."""
  if op in _COMMUTATIVE:
    a, b = sorted((a, b))
  return f"{a}{op}{b}"
