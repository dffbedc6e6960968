"""Named evaluation suites: what `ptx eval --task NAME` evaluates.

A suite is an environment plus its task records. The generated suites
(`arithmetic`, `countdown`, `needle`, `calculator`, `terminal`, `docqa`) need no
files: records 0..n-1 of a seeded stream of the task's held-out problems
(`ptx.data.splits`: no training stream of the task draws them; `needle`
cycles over its (length, depth) grid, and its report is read per cell;
`terminal` is `ShellEnv` on the buggy projects of
`ptx.envs.terminal`; `docqa` asks about generated documents none
of whose questions a training stream asks, its budgets counted in the
policy's tokens, so it needs the tokenizer).
The file suites (`math`, `code`, `shell`, `exact`) read a JSONL file of records in the
format their environment documents (`exact`: `{"prompt", "answer"}` records whose prompts are
sampled as written, `math` without its `\\boxed{}` instruction).

`calculator` (word problems with a calculator tool), `terminal`, `docqa` and
`shell` are multi-turn (`Environment.max_turns` > 1): their episodes are played on the
rollout engine (`ptx.episodes.evaluation.evaluate_episodes`), the others sampled
once per sample (`ptx.episodes.evaluation.evaluate`). `label` names a report
after its suite (and for `needle` adds its accuracy per cell).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ptx.data.arithmetic import ArithmeticTask
from ptx.data.records import decode
from ptx.data.tokenizer import Tokenizer
from ptx.data.sources import JsonlSource
from ptx.envs import needle
from ptx.envs.base import Environment
from ptx.envs.calculator import CalculatorEnv, CalculatorTasks
from ptx.envs.countdown import CountdownEnv, CountdownTask
from ptx.envs.docqa import DocQAEnv, DocQATasks
from ptx.envs.exact_answer import ExactAnswerEnv
from ptx.envs.python_tests import PythonTestsEnv
from ptx.envs.shell import ShellEnv
from ptx.envs.terminal import TerminalTasks

_BOXED = " Put the final answer in \\boxed{}."
# name: (the environment for the policy's tokenizer, the task stream of a seed).
_GENERATED: dict[str, tuple[Callable[[Tokenizer], Environment], Callable[[int], Any]]] = {
    "arithmetic": (lambda _: ExactAnswerEnv(),
                   lambda seed: ArithmeticTask(seed=seed, max_digits=3, ops="+-*", split="held_out")),
    "countdown": (lambda _: CountdownEnv(), lambda seed: CountdownTask(seed=seed, split="held_out")),
    "needle": (lambda _: needle.NeedleEnv(), lambda seed: needle.NeedleTask(seed=seed, split="held_out")),
    "calculator": (lambda _: CalculatorEnv(), lambda seed: CalculatorTasks(seed=seed, split="held_out")),
    "terminal": (lambda _: ShellEnv(), lambda seed: TerminalTasks(seed=seed, split="held_out")),
    "docqa": (DocQAEnv, lambda seed: DocQATasks(seed=seed, split="held_out")),
}
# The generated suites whose environment counts the policy's tokens: they need its tokenizer.
_TOKENIZED = ("docqa",)
_FILES: dict[str, Callable[[], Environment]] = {
    "math": lambda: ExactAnswerEnv(instruction=_BOXED), "code": PythonTestsEnv, "shell": ShellEnv,
    # Prompts used exactly as written (e.g. already rendered through a chat template), final answer checked.
    "exact": ExactAnswerEnv,
}
# The suites that read task records from a file.
FILE_SUITES = tuple(_FILES)
NAMES = tuple(_GENERATED) + FILE_SUITES


def load(name: str, *, n: int = 100, seed: int = 0, path: str | os.PathLike | None = None,
         tokenizer: Tokenizer | None = None) -> tuple[Environment, list[dict[str, Any]]]:
  """Returns the environment and task records of suite `name`.

  Args:
    name: one of NAMES.
    n: how many records (the first n of the stream or the file).
    seed: the stream of a generated suite.
    path: the JSONL file of a file suite.
    tokenizer: the policy's tokenizer; `docqa` budgets its prompts and
      replies in its tokens, and needs it.

  Returns:
    (environment, records).
  """
  if n < 1:
    raise ValueError(f"suites.load: n must be >= 1, got {n}")
  if name in _GENERATED:
    if name in _TOKENIZED and tokenizer is None:
      raise ValueError(f"suite {name!r} counts its prompts and replies in the policy's tokens: pass tokenizer")
    make_env, make_tasks = _GENERATED[name]
    tasks = make_tasks(seed)
    return make_env(tokenizer), [tasks[i] for i in range(n)]
  if name not in _FILES:
    raise ValueError(f"unknown evaluation suite {name!r}; known: {', '.join(NAMES)}")
  if path is None:
    raise ValueError(f"suite {name!r} reads task records from a JSONL file: pass path")
  source = JsonlSource(path)
  return _FILES[name](), [decode(source[i]) for i in range(min(n, len(source)))]


def label(name: str, tasks: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, Any]:
  """Returns suite `name`'s report (`ptx.episodes.evaluation`'s, of its `tasks`) labelled with the suite.

  Args:
    name: the suite's name, kept in the report as "suite".
    tasks: its task records, in the report's order.
    report: `ptx.episodes.evaluation.evaluate`'s or `evaluate_episodes`' report.

  Returns:
    The report with "suite" and, for needle, "cells" (accuracy per haystack
    length and needle depth: long context is read per cell).
  """
  labelled = {"suite": name, **report}
  if name == "needle":
    labelled["cells"] = needle.cells(labelled, tasks)
  return labelled
