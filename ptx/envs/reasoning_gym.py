"""reasoning-gym task families (Apache-2.0) as one environment and a mixed task stream, held out by seed range.

reasoning-gym generates problems of some hundred families (arithmetic, logic, word games, puzzles), each with its
own answer checker. A record is `{"prompt", "family", "entry"}`: the question with an instruction to answer inside
`<answer></answer>` tags, the family's name, and reasoning-gym's entry (question, answer, metadata), which its
checker reads. The reward is the checker's score of the last tagged answer (in [0, 1]; some families give partial
credit, such as 0.01 for a well-formed wrong answer); a sample passes when it scores 1.
`ReasoningGymEnv.demonstration(task)` is the question answered by reasoning-gym's own answer in tags, without
reasoning: for teaching a model the answer form by SFT, not how to reason.

`ReasoningGymTasks` mixes families by weight into one endless, random-access stream: task i's family is a seeded
draw and its problem is item j of the family's generator, whose problems are pure functions of j. Training draws j
in [0, 2^30) and the held-out split in [2^30, 2^31): no held-out problem is generated from a seed training uses.
Families whose generator cannot be indexed that way (a few precompute a fixed list) are refused by name.

Threat model. The checkers run in this process, outside the OS sandbox, so a family whose checker (its
`score_answer` and the functions of its module that it calls) evaluates text (`eval`, `exec`, sympy's
`parse_expr` or `sympify`: string_insertion, countdown, the integration families, ...) is refused by name: a
policy would answer with code. The answer a checker reads is at most
`MAX_ANSWER` characters (a longer one is wrong, unread), and a checker that raises scores the sample wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ptx.envs.base import Outcome, SingleTurn, Step, field, prompt_text
from ptx.envs.mixture import weighted_names

INSTRUCTION = ("\n\nThink it through, then give only the final answer inside <answer></answer> tags, in the format "
               "the question asks for.")
# A mix a small model can score on: arithmetic, counting, sorting, word games, logic and family trees, each checked
# by its exact answer (families whose checker wants more than the answer, like propositional_logic, are left out).
DEFAULT_FAMILIES = ("basic_arithmetic", "chain_sum", "leg_counting", "letter_counting", "spell_backward",
                    "word_sorting", "gcd", "lcm", "syllogism", "family_relationships", "simple_equations",
                    "base_conversion")
MAX_ANSWER = 4096
# What a checker must not call, since it runs in this process (see the threat model above).
_EVALUATES = ("eval(", "exec(", "parse_expr", "sympify")
_SPAN = 1 << 30  # problems per split: train j in [0, SPAN), held-out j in [SPAN, 2 * SPAN)
_SPLITS = {"train": 0, "held_out": _SPAN}
_INSTALL = "pip install 'ptx[rl]' (reasoning-gym==0.1.25)"


def _library():
  try:
    import reasoning_gym  # the rl extra
  except ImportError:
    raise ModuleNotFoundError(f"reasoning-gym task families need the reasoning-gym package: {_INSTALL}") from None
  return reasoning_gym


@functools.cache
def _generator(family: str):
  """The family's problem generator: item j is the problem of reasoning-gym's seed j (`create_dataset(seed=j)[0]`)."""
  library = _library()
  try:
    return library.create_dataset(family, seed=0, size=1)
  except (KeyError, ValueError) as e:
    raise ValueError(f"reasoning-gym has no task family {family!r} ({e})") from None


def _checker_source(family: str) -> str:
  """The source of the family's `score_answer` and of the functions of its class or module that it calls."""
  kind = type(_generator(family))
  module = sys.modules[kind.__module__]
  source = inspect.getsource(kind.score_answer)
  for name in set(re.findall(r"\b([A-Za-z_]\w*)\(", source)):
    called = getattr(kind, name, None) or getattr(module, name, None)
    if inspect.isfunction(called) and called.__module__ == module.__name__:
      source += inspect.getsource(called)
  return source


@functools.cache
def _checker(family: str):
  """The family's answer checker, refused when it evaluates text (a policy would answer with code)."""
  found = [name.rstrip("(") for name in _EVALUATES if name in _checker_source(family)]
  if found:
    raise ValueError(f"reasoning-gym family {family!r} is refused: its checker calls {', '.join(found)}, and "
                     "checkers run outside the sandbox, where a policy's answer must not run as code")
  return _library().get_score_answer_fn(family)


def problem(family: str, j: int) -> dict[str, Any]:
  """Problem j of `family`: reasoning-gym's entry (question, answer, metadata).

  Raises:
    ValueError: the family is unknown, or its generator cannot be indexed by seed.
  """
  try:
    return _generator(family)[j]
  except IndexError:
    raise ValueError(f"reasoning-gym family {family!r} precomputes a fixed list of problems, so it cannot be drawn "
                     "by seed range (and held out by one): choose another family") from None


def parse_families(entries: Sequence[str]) -> tuple[tuple[str, ...], tuple[float, ...]]:
  """(families, weights) of "NAME" or "NAME:WEIGHT" entries (weight 1 when left out); empty: the default mix.

  Raises:
    ValueError: naming an entry whose weight is not a positive number, or a family named twice.
  """
  if not entries:
    return DEFAULT_FAMILIES, (1.0,) * len(DEFAULT_FAMILIES)
  return weighted_names(entries, "reasoning-gym families")


@dataclasses.dataclass(frozen=True)
class ReasoningGymTasks:
  """An endless, random-access mix of families: task i is a pure function of (families, weights, seed, split, i).

  Attributes:
    families: reasoning-gym family names.
    weights: their sampling weights (one each; empty: equal).
    seed: selects the draws.
    split: "train" or "held_out" (disjoint ranges of generator seeds).
  """

  families: tuple[str, ...] = DEFAULT_FAMILIES
  weights: tuple[float, ...] = ()
  seed: int = 0
  split: str = "train"

  def __post_init__(self):
    if self.split not in _SPLITS:
      raise ValueError(f"ReasoningGymTasks.split must be one of {tuple(_SPLITS)}, got {self.split!r}")
    if not self.families or (self.weights and len(self.weights) != len(self.families)):
      raise ValueError(f"ReasoningGymTasks needs families and one weight each, got {self.families} and "
                       f"{self.weights}")
    if any(not w > 0 for w in self.weights):
      raise ValueError(f"ReasoningGymTasks.weights must be positive, got {self.weights}")
    for family in self.families:  # unknown, not drawable by seed, or an unsafe checker: refused now, by name
      problem(family, _SPLITS[self.split])
      _checker(family)

  def generator_seed(self, i: int) -> int:
    """The generator seed j of task i: in [0, 2^30) for train, [2^30, 2^31) for held_out."""
    return _SPLITS[self.split] + (self.seed * 1_000_003 + i) % _SPAN

  def __getitem__(self, i: int) -> dict[str, Any]:
    weights = np.asarray(self.weights or (1.0,) * len(self.families))
    family = self.families[np.random.default_rng([self.seed, i]).choice(len(self.families), p=weights / weights.sum())]
    entry = problem(family, self.generator_seed(i))
    return {"prompt": entry["question"] + INSTRUCTION, "family": family, "entry": entry}


def tagged_answer(text: str) -> str | None:
  """The last `<answer>...</answer>` of `text`, stripped; None without one (found in one pass from the end)."""
  end = text.rfind("</answer>")
  start = text.rfind("<answer>", 0, end) if end >= 0 else -1
  return text[start + len("<answer>"):end].strip() if start >= 0 else None


@dataclasses.dataclass(frozen=True)
class ReasoningGymEnv:
  """Single-turn: the model answers a reasoning-gym problem; the family's own checker scores the tagged answer."""

  name: str = "reasoning_gym"
  max_turns: int = 1
  sandboxed: bool = False

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks a `{"prompt", "family", "entry"}` record's fields (the family's checker is looked up)."""
    prompt_text(task, self.name)
    entry = field(task, "entry", dict, self.name)
    if "answer" not in entry or "question" not in entry:
      raise ValueError(f"{self.name} task field 'entry' must be reasoning-gym's entry (question, answer, "
                       f"metadata), got keys {sorted(entry)}")
    try:
      _checker(field(task, "family", str, self.name))
    except (KeyError, ValueError) as e:
      raise ValueError(f"{self.name} task field 'family': {e}") from None

  def reset(self, task: Mapping[str, Any]) -> SingleTurn:
    """Starts an episode for a `{"prompt", "family", "entry"}` record."""
    self.validate(task)
    return SingleTurn(prompt_text(task, self.name), lambda action: self._score(task, action))

  def demonstration(self, task: Mapping[str, Any]) -> list[dict[str, str]]:
    """The question answered right, as chat messages: the prompt, then reasoning-gym's answer in tags.

    Raises:
      ValueError: for a record `validate` refuses, or whose answer the family's checker does not score 1.
    """
    return self.reset(task).demonstration(f"<answer>{task['entry']['answer']}</answer>",
                                          f"{self.name} task of {task['family']}: its own answer scores")

  def _score(self, task: Mapping[str, Any], action: str) -> Step:
    answer = tagged_answer(action)
    if answer is None:
      return Step.final(Outcome.NO_ANSWER, "no <answer></answer> found")
    if len(answer) > MAX_ANSWER:
      return Step.final(Outcome.WRONG, f"the answer has {len(answer)} characters, more than {MAX_ANSWER}")
    try:
      score = float(_checker(task["family"])(answer, task["entry"]))
    except Exception as e:  # noqa: BLE001 - a checker tripped by the model's answer: the model's failure
      return Step.final(Outcome.WRONG, f"{task['family']}'s checker raised {type(e).__name__} on the answer")
    if not 0.0 <= score <= 1.0:  # nan included
      return Step.final(Outcome.WRONG, f"{task['family']}'s checker gave {score!r}, outside [0, 1]")
    if score >= 1.0:
      return Step.final(Outcome.OK, f"{answer[:80]!r} is {task['family']}'s answer", reward=1.0)
    return Step.final(Outcome.WRONG, f"{answer[:80]!r}: {task['family']} scores it {score:g}", reward=score)
