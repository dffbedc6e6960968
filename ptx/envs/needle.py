"""Needle retrieval: find one fact hidden at a controlled depth of a long filler text.

Models that nominally take long inputs often fail in the middle, so the task
grid crosses haystack lengths with needle depths, and results are read per
(length, depth) cell (`cells`). Task `i` of a `NeedleTask` is cell
`i % (len(lengths) * len(depths))`: lengths vary slowest, so the first
`len(lengths) * len(depths)` tasks cover the grid once, and further tasks
repeat it with fresh keys and numbers. Keys come from one side of the train /
held-out split (`ptx.data.splits`, by the key), so a held-out record never
asks for a key a training record named.

Task records are `{"prompt", "answer", "length", "depth"}`: `length` is the
haystack size in words (about 1.3 tokens each for English BPE vocabularies),
`depth` the needle's position as a fraction of it. The answer is a random
7-digit number; an episode is solved when the reply contains it.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ptx.data import splits
from ptx.envs.base import Outcome, SingleTurn, Step, field, prompt_text

_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
           "A river runs through the valley and the hills roll on toward the sea. ").split()
_KEYS = ("amber", "cobalt", "crimson", "emerald", "indigo", "ivory", "jade", "onyx", "scarlet", "violet")


@dataclasses.dataclass(frozen=True)
class NeedleTask:
  """The needle-in-a-haystack grid as an indexable stream of task records.

  Attributes:
    seed: selects the stream of keys and numbers.
    lengths: haystack sizes in words.
    depths: needle positions as fractions of the haystack, in [0, 1].
    split: "train" (training streams) or "held_out" (evaluation sets).
  """

  seed: int = 0
  lengths: tuple[int, ...] = (1_000, 4_000, 16_000)
  depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
  split: str = "train"

  def __post_init__(self):
    if not self.lengths or min(self.lengths) < 1:
      raise ValueError(f"NeedleTask.lengths must be positive word counts, got {self.lengths}")
    if not self.depths or not all(0.0 <= d <= 1.0 for d in self.depths):
      raise ValueError(f"NeedleTask.depths must lie in [0, 1], got {self.depths}")
    splits.check("NeedleTask", self.split)

  def __getitem__(self, index: int) -> dict[str, Any]:
    """Returns the record of task `index` (its cell is index % grid size)."""
    if index < 0:
      raise IndexError(f"NeedleTask index must be >= 0, got {index}")
    cell = index % (len(self.lengths) * len(self.depths))
    length, depth = self.lengths[cell // len(self.depths)], self.depths[cell % len(self.depths)]
    rng = np.random.default_rng([self.seed, index])

    def candidate() -> tuple[str, str]:
      key = f"{_KEYS[int(rng.integers(len(_KEYS)))]}-{int(rng.integers(100, 1000))}"
      return key, key

    key = splits.draw("NeedleTask", self.split, candidate)
    number = str(int(rng.integers(1_000_000, 10_000_000)))
    words = [_FILLER[i % len(_FILLER)] for i in range(length)]
    at = round(depth * length)
    needle = f"The magic number for {key} is {number}."
    haystack = " ".join(words[:at] + [needle] + words[at:])
    prompt = (f"{haystack}\n\nWhat is the magic number for {key}? Answer with the number only.")
    return {"prompt": prompt, "answer": number, "length": length, "depth": depth}


@dataclasses.dataclass(frozen=True)
class NeedleEnv:
  """Single turn: the reply must contain the needle's number."""

  name: str = "needle"
  max_turns: int = 1
  sandboxed: bool = False

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks a NeedleTask record's fields."""
    prompt_text(task, self.name)
    field(task, "answer", (str, int), self.name)

  def reset(self, task: Mapping[str, Any]) -> SingleTurn:
    """Starts an episode for a NeedleTask record."""
    self.validate(task)
    answer = str(task["answer"])
    return SingleTurn(prompt_text(task, self.name), lambda action: _score(action, answer))


def _score(action: str, answer: str) -> Step:
  """OK when the reply names the number, else WRONG (or NO_ANSWER without any number)."""
  numbers = re.findall(r"\d+", action)
  if answer in numbers:
    return Step.final(Outcome.OK, f"found {answer}")
  if not numbers:
    return Step.final(Outcome.NO_ANSWER, "no number in the reply")
  return Step.final(Outcome.WRONG, f"replied {numbers[0]}, not {answer}")


def cells(report: Mapping[str, Any], tasks: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
  """Accuracy per (length, depth) cell of an evaluation report over needle tasks.

  Args:
    report: `ptx.episodes.evaluation.evaluate`'s report (its `per_task` and `k`).
    tasks: the task records it evaluated, in order.

  Returns:
    {str(length): {str(depth): fraction of samples that found the needle}}.
  """
  correct, total = collections.Counter(), collections.Counter()
  for row in report["per_task"]:
    task = tasks[row["index"]]
    cell = (task["length"], task["depth"])
    correct[cell] += row["correct"]
    total[cell] += report["k"]
  table: dict[str, dict[str, float]] = {}
  for length, depth in sorted(total):
    table.setdefault(str(length), {})[str(depth)] = correct[length, depth] / total[length, depth]
  return table
