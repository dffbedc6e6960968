"""Named evaluation suites: what `ptx eval --task NAME` evaluates.

A suite is an environment plus its task records. The generated suites
(`arithmetic`, `countdown`, `needle`, `calculator`, `terminal`, `docqa`, and the visual questions
`visual_counting`, `visual_clock`, `visual_bar_chart`, `visual_table`, `visual_grid`, `visual_digit_sums`) need no
files: records 0..n-1 of a seeded stream of the task's held-out problems
(`ptx.data.splits`: no training stream of the task draws them; `needle`
cycles over its (length, depth) grid, and its report is read per cell;
`terminal` is `ShellEnv` on the buggy projects of
`ptx.envs.terminal`; `docqa` asks about generated documents none
of whose questions a training stream asks, its budgets counted in the
policy's tokens, so it needs the tokenizer; a visual suite's records are image chats (`ptx.envs.visual`), its held-out
problems never posed in training (`visual_digit_sums` shows only held-out images, and needs scikit-learn's digits);
until sampling takes images, evaluation refuses their image prompts (`ptx.episodes.evaluation`) rather than score a
model that never saw the picture.
The benchmark suites read the data an installed package ships, the first n records in a fixed order:
`humaneval` (all 164 problems, as published) and `humaneval_held_out` (the last 32, which `ptx grpo --env code`
never trains on), in completion form or, with `chat`, as a request for the whole function (`ptx.envs.humaneval`);
`bfcl`, BFCL's held-out requests (252 of simple, multiple, parallel and parallel_multiple, none of which
`ptx grpo --env bfcl` trains on), called in the form the policy's chat template teaches (`ptx.envs.bfcl`).
`reasoning_gym` draws held-out problems of reasoning-gym families (a default mix, or the caller's) from generator
seeds no training stream draws (`ptx.envs.reasoning_gym`); its report adds the accuracy per family.
The file suites (`math`, `code`, `shell`, `exact`) read a JSONL file of records in the
format their environment documents (`exact`: `{"prompt", "answer"}` records whose prompts are
sampled as written, its answers matched as math or, with `answer_match="text"`, as words; `math` without its
`\\boxed{}` instruction).

`calculator` (word problems with a calculator tool), `terminal`, `docqa` and
`shell` are multi-turn (`Environment.max_turns` > 1): their episodes are played on the
rollout engine (`ptx.episodes.evaluation.evaluate_episodes`), the others sampled
once per sample (`ptx.episodes.evaluation.evaluate`). `label` names a report
after its suite (and for `needle` adds its accuracy per cell).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
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
from ptx.envs import humaneval
from ptx.envs.bfcl import BFCLEnv, BFCLTasks
from ptx.envs.exact_answer import ExactAnswerEnv
from ptx.envs import reasoning_gym
from ptx.envs.python_tests import PythonTestsEnv
from ptx.envs.reasoning_gym import ReasoningGymEnv, ReasoningGymTasks
from ptx.envs.shell import ShellEnv
from ptx.envs.terminal import TerminalTasks
from ptx.envs.tools import family_format
from ptx.envs import visual_tasks
from ptx.envs.handwritten_digits import DigitSums
from ptx.envs.visual import VisualEnv, VisualTasks

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
    **{f"visual_{family}": (lambda _: VisualEnv(), lambda seed, make=make: VisualTasks(make(), seed, "held_out"))
       for family, make in {**visual_tasks.GENERATORS, DigitSums.family: DigitSums}.items()},
}
# The suites whose environment counts the policy's tokens, or writes tool calls in its family's form: they need its
# tokenizer.
_TOKENIZED = ("docqa", "bfcl")
# name: the environment, of the `exact` suite's answer match ("math" or "text").
_FILES: dict[str, Callable[[str], Environment]] = {
    "math": lambda _: ExactAnswerEnv(instruction=_BOXED), "code": lambda _: PythonTestsEnv(),
    "shell": lambda _: ShellEnv(),
    # Prompts used exactly as written (e.g. already rendered through a chat template), final answer checked.
    "exact": lambda match: ExactAnswerEnv(match=match),
}
# Benchmarks whose data an installed package ships: name: (the environment for the policy's tokenizer, the records
# in chat or completion form).
_BENCHMARKS: dict[str, tuple[Callable[[Tokenizer], Environment], Callable[[bool], Sequence[dict[str, Any]]]]] = {
    "humaneval": (lambda _: PythonTestsEnv(limits=humaneval.LIMITS),
                  lambda chat: [humaneval.record(p, chat=chat) for p in humaneval.split("all")]),
    "humaneval_held_out": (lambda _: PythonTestsEnv(limits=humaneval.LIMITS),
                           lambda chat: [humaneval.record(p, chat=chat) for p in humaneval.split("held_out")]),
    # Calls written in the form the policy's chat template teaches; the prompt shows the functions (chat or not).
    "bfcl": (lambda tokenizer: BFCLEnv(tool_format=family_format(tokenizer)),
             lambda _: [*BFCLTasks(seed=0, split="held_out")]),
}
# The suites that read task records from a file.
FILE_SUITES = tuple(_FILES)
NAMES = tuple(_GENERATED) + ("reasoning_gym",) + tuple(_BENCHMARKS) + FILE_SUITES


def load(name: str, *, n: int = 100, seed: int = 0, path: str | os.PathLike | None = None,
         tokenizer: Tokenizer | None = None, answer_match: str = "math", chat: bool = False,
         families: Sequence[str] = ()) -> tuple[Environment, list[dict[str, Any]]]:
  """Returns the environment and task records of suite `name`.

  Args:
    name: one of NAMES.
    n: how many records (the first n of the stream or the file).
    seed: the stream of a generated suite.
    path: the JSONL file of a file suite.
    tokenizer: the policy's tokenizer; `docqa` budgets its prompts and
      replies in its tokens, and needs it.
    answer_match: how `exact` matches answers, "math" or "text" (`ExactAnswerEnv.match`).
    chat: a benchmark's records in chat form (a request the chat template renders) rather than completion form.
    families: the `reasoning_gym` suite's families, "NAME" or "NAME:WEIGHT" (empty: its default mix).

  Returns:
    (environment, records).
  """
  if n < 1:
    raise ValueError(f"suites.load: n must be >= 1, got {n}")
  if name in _TOKENIZED and tokenizer is None:
    raise ValueError(f"suite {name!r} needs the policy's tokenizer (its token counts or its tool-call form)")
  if name == "reasoning_gym":
    tasks = ReasoningGymTasks(*reasoning_gym.parse_families(families), seed=seed, split="held_out")
    return ReasoningGymEnv(), [tasks[i] for i in range(n)]
  if name in _GENERATED:
    make_env, make_tasks = _GENERATED[name]
    tasks = make_tasks(seed)
    return make_env(tokenizer), [tasks[i] for i in range(n)]
  if name in _BENCHMARKS:
    make_env, records = _BENCHMARKS[name]
    return make_env(tokenizer), list(records(chat)[:n])
  if name not in _FILES:
    raise ValueError(f"unknown evaluation suite {name!r}; known: {', '.join(NAMES)}")
  if path is None:
    raise ValueError(f"suite {name!r} reads task records from a JSONL file: pass path")
  source = JsonlSource(path)
  return _FILES[name](answer_match), [decode(source[i]) for i in range(min(n, len(source)))]


def label(name: str, env: Environment, tasks: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, Any]:
  """Returns suite `name`'s report (`ptx.episodes.evaluation`'s, of its `tasks`) labelled with the suite.

  Args:
    name: the suite's name, kept in the report as "suite".
    env: its environment.
    tasks: its task records, in the report's order.
    report: `ptx.episodes.evaluation.evaluate`'s or `evaluate_episodes`' report.

  Returns:
    The report with "suite"; for a suite of exact answers, "answer_match" (how answers were matched, math or
    text); for reasoning_gym, "families" (accuracy per family); for bfcl, "categories" (accuracy per BFCL
    category: BFCL reports simple, multiple and parallel apart); for needle, "cells" (accuracy per haystack length
    and needle depth: long context is read per cell).
  """
  labelled = {"suite": name, **report}
  if isinstance(env, ExactAnswerEnv):
    labelled["answer_match"] = env.match
  if isinstance(env, ReasoningGymEnv):
    labelled["families"] = _accuracy_by(labelled, [t["family"] for t in tasks])
  if isinstance(env, BFCLEnv):
    labelled["categories"] = _accuracy_by(labelled, [t["category"] for t in tasks])
  if name == "needle":
    labelled["cells"] = needle.cells(labelled, tasks)
  return labelled


def _accuracy_by(report: dict[str, Any], groups: list[str]) -> dict[str, float]:
  """The fraction of samples that passed, per group of tasks (`groups[i]`: task i's group)."""
  passed: dict[str, list[int]] = {}
  for task in report["per_task"]:
    counts = passed.setdefault(groups[task["index"]], [0, 0])
    counts[0] += task["correct"]
    counts[1] += len(task["outcomes"])
  return {group: correct / total for group, (correct, total) in sorted(passed.items())}
