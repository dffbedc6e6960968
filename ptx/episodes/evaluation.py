"""Evaluates a policy on an environment: pass@k, mean@k, outcome counts, a JSON report.

Two ways to play a task's k samples, one report:

- `evaluate(generate, env, tasks, k=...)`, for single-turn environments:
  `generate(prompts, k)` gives k completions of every task's prompt (a
  `ptx.sampling.text.TextSampler`), each scored as its own episode through
  `ptx.episodes.scoring.run_steps` (concurrent, infrastructure faults retried).
- `evaluate_episodes(engine, params, env, tasks, fmt, k=...)`, for
  multi-turn environments: the episodes are played by
  `ptx.episodes.loop.play` on the rollout engine, as training plays them:
  token in, token out (each turn sampled from the live sequence, each
  environment reply encoded once and appended with `extend`; nothing is
  decoded and encoded again), the k samples of a task sharing its prompt's
  pages. A step that raises scores its episode "infra_error", not retried.

pass@k is the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k)
for n samples with c correct, computed as a product that neither overflows
nor cancels. mean@k is the mean reward over all samples.

The report keeps what the model wrote: "samples" holds one entry per
sample (task index, sample index, reward, outcome, reason, and the
"completion": the text after the prompt), the first of each task with its
prompt. An episode's completion is the decoding of its trajectory's tokens
after the first prompt (every turn as sampled, every reply as appended,
with the chat template's markup between them); its entry adds "messages"
(the model's turns and the environment's replies as text, by role), "turns",
"tool_calls" and "tool_errors". `write_report` puts them in `samples.jsonl`,
one JSON line each, beside the summary; both files are replaced atomically,
so a crash leaves the old file or the new one, never part of one.

Several suites' reports form a directory of report directories, one per
suite (`SUITE/eval.json` and its samples; `write_suites`, `read_suites`).
A suite regressed when its headline statistic worsened by more than a
threshold (`regressed`): pass@1 fell, or for a perplexity report
(`ptx.episodes.likelihood`) bits per byte rose; the one rule that
checkpoint evaluations flag and `compare_suites` reports.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ptx import paths
from ptx.data import image_chat
from ptx.episodes import loop
from ptx.envs.base import Environment, Episode, Outcome, Step, sandbox_backend
from ptx.episodes.scoring import run_steps
from ptx.episodes.turn_format import TurnFormat
from ptx.sampling.engine.engine import RolloutEngine

Generate = Callable[[list[str], int], list[list[str]]]
# The completions of a report, beside its summary.
SAMPLES_FILE = "samples.jsonl"
# A report's summary in its directory (`ptx eval --out DIR`, each suite's directory of `write_suites`).
REPORT_FILE = "eval.json"


class Scored(Protocol):
  """How one sample ended: a final `Step` or an episode's `Trajectory`."""

  reward: float
  outcome: Outcome | None
  reason: str


def pass_at_k(n: int, c: int, k: int) -> float:
  """Returns the unbiased pass@k estimate for one task.

  Args:
    n: samples drawn.
    c: samples that were correct.
    k: the k in pass@k, at most n.

  Returns:
    The probability that at least one of k samples (drawn without replacement
    from the n) is correct.
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _ks(k: int) -> list[int]:
  """Powers of two below k, and k."""
  return sorted({2 ** i for i in range(k.bit_length()) if 2 ** i < k} | {k})


def evaluate(generate: Generate, env: Environment, tasks: Sequence[Mapping[str, Any]], *, k: int,
             concurrency: int = 32) -> dict[str, Any]:
  """Samples k completions per task of a single-turn environment, scores them, and returns the report.

  Args:
    generate: `generate(prompts, k) -> completions`, k per prompt, in order.
    env: the environment that scores them (`max_turns` 1).
    tasks: task records for `env.reset`.
    k: samples per task.
    concurrency: scoring steps run at once.

  Returns:
    The report: "env", "tasks", "k", "pass@k" (for each power of two below k
    and k), "mean@k", "outcomes" (counts), "sandbox" (the backend that ran
    the model's code; None for environments that run none), "per_task"
    details, and "samples" (see the module docstring).

  Raises:
    ValueError: for a multi-turn environment (`evaluate_episodes` plays
      those), k < 1, no tasks, a task record `env.reset` refuses (naming
      it), or `generate` returning the wrong number of completions.
  """
  if env.max_turns > 1:
    raise ValueError(f"evaluate: {env.name} is multi-turn (max_turns {env.max_turns}): play its episodes on the "
                     "rollout engine with evaluate_episodes")
  _check(k, tasks)
  episodes: list[list[Episode]] = []
  try:
    for index, task in enumerate(tasks):
      try:
        episodes.append([env.reset(task) for _ in range(k)])
      except ValueError as e:
        raise ValueError(f"evaluate: task {index}: {e}") from None
    completions = generate([row[0].prompt for row in episodes], k)
    if len(completions) != len(episodes) or any(len(c) != k for c in completions):
      raise ValueError(f"generate returned {[len(c) for c in completions]} completions; wanted {k} for each of "
                       f"{len(episodes)} prompts")
    steps = run_steps([lambda e=e, a=a: e.step(a) for row, texts in zip(episodes, completions)
                       for e, a in zip(row, texts)], concurrency)
    # One action per episode: a step that does not end it leaves it unanswered.
    steps = [s if s.done else Step.final(Outcome.NO_ANSWER, "out of turns") for s in steps]
    finals = [steps[r * k:(r + 1) * k] for r in range(len(episodes))]
  finally:
    for episode in (e for row in episodes for e in row):
      episode.close()
  samples = _samples([row[0].prompt for row in episodes], finals, completions)
  return {**_report(env.name, finals, k), "sandbox": sandbox_backend(env), "samples": samples}


def evaluate_episodes(engine: RolloutEngine, params: Any, env: Environment, tasks: Sequence[Mapping[str, Any]],
                      fmt: TurnFormat, *, k: int, max_turn_tokens: int,
                      max_episode_tokens: int | None = None) -> dict[str, Any]:
  """Plays k episodes of every task on the rollout engine (`ptx.episodes.loop.play`) and returns the report.

  Args:
    engine: the rollout engine, holding nothing; its seed fixes the tokens.
    params: the policy's parameters, as `engine.step` takes them.
    env: the environment.
    tasks: task records for `env.reset`.
    fmt: the episodes' token form (prompt, turn stop ids, replies).
    k: episodes per task, played as one group sharing its prompt's pages.
    max_turn_tokens: tokens the model may sample in one turn.
    max_episode_tokens: tokens an episode may add after its first prompt
      (turns and replies); an episode that would pass it, or the engine's
      context, ends with outcome "limit" (default: only the context bounds it).

  Returns:
    `evaluate`'s report, built from the trajectories; each sample's entry
    adds "messages", "turns", "tool_calls" and "tool_errors" (see the
    module docstring).

  Raises:
    ValueError: for k < 1, no tasks, or (naming the task) a record
      `env.reset` refuses or a first prompt that leaves no room.
  """
  _check(k, tasks)
  played = loop.play(engine, params, env, tasks, fmt, samples=k, max_turn_tokens=max_turn_tokens,
                             max_episode_tokens=max_episode_tokens)
  rows = [played[i * k:(i + 1) * k] for i in range(len(tasks))]
  texts = [[fmt.tokenizer.decode(t.tokens[t.prompt_len:].tolist()) for t in row] for row in rows]
  samples = _samples([row[0].messages[0]["content"] for row in rows], rows, texts)
  for entry, t in zip(samples, played):
    entry.update(messages=[dict(m) for m in t.messages[1:]], turns=t.turns, tool_calls=t.tool_calls,
                 tool_errors=t.tool_errors)
  return {**_report(env.name, rows, k), "sandbox": sandbox_backend(env), "samples": samples}


def _check(k: int, tasks: Sequence[Mapping[str, Any]]) -> None:
  """Refuses k < 1, an empty task list, and tasks whose prompts hold images, which the samplers cannot show yet."""
  if k < 1:
    raise ValueError(f"evaluate: k must be >= 1, got {k}")
  if not tasks:
    raise ValueError("evaluate: tasks is empty")
  with_images = [i for i, task in enumerate(tasks) if image_chat.has_parts(task.get("prompt"))]
  if with_images:  # sampling their text alone would score a model that never saw the picture
    raise ValueError(f"evaluate: task {with_images[0]}'s prompt holds content parts (images, e.g. a visual suite); "
                     "sampling does not take images yet, so the model would not see them")


def _report(env_name: str, finals: Sequence[Sequence[Scored]], k: int) -> dict[str, Any]:
  """A report's scores: pass@k, mean@k, outcome counts and per-task details of each task's k samples."""
  per_task, outcomes = [], collections.Counter()
  for index, steps in enumerate(finals):
    outcomes.update(str(s.outcome) for s in steps)
    per_task.append({"index": index, "correct": sum(s.outcome == Outcome.OK for s in steps),
                     "rewards": [s.reward for s in steps], "outcomes": [str(s.outcome) for s in steps],
                     "reasons": [s.reason for s in steps]})
  rewards = [r for t in per_task for r in t["rewards"]]
  return {
      "env": env_name, "tasks": len(finals), "k": k,
      "pass@k": {str(j): sum(pass_at_k(k, t["correct"], j) for t in per_task) / len(per_task) for j in _ks(k)},
      "mean@k": sum(rewards) / len(rewards),
      "outcomes": dict(sorted(outcomes.items())),
      "per_task": per_task,
  }


def _samples(prompts: list[str], finals: Sequence[Sequence[Scored]],
             texts: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
  """One entry per sample, in task and sample order; the first of each task carries its prompt."""
  out = []
  for task, (prompt, steps, written) in enumerate(zip(prompts, finals, texts)):
    for sample, (step, text) in enumerate(zip(steps, written)):
      entry = {"task": task, "sample": sample, "reward": step.reward, "outcome": str(step.outcome),
               "reason": step.reason}
      out.append({**entry, "prompt": prompt, "completion": text} if sample == 0 else {**entry, "completion": text})
  return out


def write_report(report: Mapping[str, Any], path: str | os.PathLike) -> None:
  """Writes a report's summary as indented JSON to `path`, and its samples to samples.jsonl beside it.

  Both texts are made before either file is touched, and the samples are
  replaced first (each at once, `ptx.paths.write_atomic`), so a summary is
  never newer than the samples beside it.
  """
  path = paths.path(path)
  summary = json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1) + "\n"
  if "samples" in report:
    paths.write_atomic(path.with_name(SAMPLES_FILE), "".join(json.dumps(s) + "\n" for s in report["samples"]))
  paths.write_atomic(path, summary)


def read_report(path: str | os.PathLike) -> dict[str, Any]:
  """Reads the summary of a report written by `write_report` (without its samples)."""
  report = json.loads(paths.path(path).read_text())
  for key in _PERPLEXITY if "bits_per_byte" in report else ("pass@k", "mean@k", "outcomes", "tasks", "k"):
    if key not in report:
      raise ValueError(f"{path} is not an evaluation report: it lacks {key!r}")
  return report


def write_suites(reports: Mapping[str, Mapping[str, Any]], directory: str | os.PathLike) -> None:
  """Writes each suite's report as `directory/SUITE/eval.json` (and samples.jsonl beside it)."""
  for name, report in reports.items():
    (paths.path(directory) / name).mkdir(parents=True, exist_ok=True)
    write_report(report, paths.path(directory) / name / REPORT_FILE)


def read_suites(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
  """The reports at `path` by suite: a report file, a report directory, or a directory of suites' directories.

  A single report is named by its "suite" (or, for a report without one,
  its environment).

  Raises:
    ValueError: `path` holds no report.
  """
  path = paths.path(path)
  if not path.exists():
    raise ValueError(f"{path}: no such report file or directory")
  if path.is_dir() and (path / REPORT_FILE).is_file():
    path = path / REPORT_FILE
  if path.is_file():
    report = read_report(path)
    return {report.get("suite", report.get("env", path.stem)): report}
  children = sorted(c for c in path.iterdir() if (c / REPORT_FILE).is_file())
  if not children:
    raise ValueError(f"{path} holds no evaluation report (neither a report file, {REPORT_FILE}, nor "
                     f"SUITE/{REPORT_FILE})")
  return {c.name: read_report(c / REPORT_FILE) for c in children}


# A perplexity report's statistics (`ptx.episodes.likelihood.perplexity_report`), the headline first.
_PERPLEXITY = ("bits_per_byte", "byte_perplexity", "token_perplexity", "tasks")


def headline(report: Mapping[str, Any]) -> tuple[str, float, bool]:
  """(name, value, whether higher is better) of the statistic a report is compared by: pass@1, or bits per byte."""
  if "bits_per_byte" in report:
    return "bits_per_byte", report["bits_per_byte"], False
  return "pass@1", report["pass@k"]["1"], True


def regressed(before: Mapping[str, Any], after: Mapping[str, Any], threshold: float) -> bool:
  """Whether `after`'s headline is more than `threshold` worse than `before`'s (pass@1 below, bits per byte above)."""
  _, a, higher = headline(before)
  _, b, _ = headline(after)
  return _fell(a, b, threshold) if higher else _fell(-a, -b, threshold)


def _rows(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, float, float]]:
  """(metric, A, B) of a suite in `compare_suites`, the headline first."""
  if "bits_per_byte" in a:
    return [(m, a[m], b[m]) for m in _PERPLEXITY[:3]]
  k = str(max(int(j) for j in set(a["pass@k"]) & set(b["pass@k"])))
  return [("pass@1", a["pass@k"]["1"], b["pass@k"]["1"]), (f"pass@{k}", a["pass@k"][k], b["pass@k"][k]),
          ("mean@k", a["mean@k"], b["mean@k"])]


def _fell(before: float, after: float, threshold: float) -> bool:
  """Whether a score fell from `before` to `after` by more than `threshold`."""
  # Scores are means of ratios: rounding the drop to 1e-12 keeps a drop that equals the threshold in exact
  # arithmetic (0.5 - 0.45 is 0.05000000000000002 in float64) from being flagged by float error alone.
  return round(before - after, 12) > threshold


def compare_suites(before: Mapping[str, Mapping[str, Any]], after: Mapping[str, Mapping[str, Any]], *,
                   threshold: float) -> tuple[str, list[str]]:
  """Returns the per-suite table of A (before) vs B (after) and the suites that regressed.

  Args:
    before: reports by suite (`read_suites`), e.g. a run's baseline.
    after: reports by suite, e.g. its last checkpoint's.
    threshold: the largest drop of pass@1 (rise of bits per byte) that is not a regression.

  Raises:
    ValueError: A and B share no suite.

  Returns:
    (table, regressed): one row per suite and metric (pass@1, pass@k at the
    largest k both reports have, mean@k; a perplexity report's bits per byte,
    byte and token perplexity: A, B, B - A), a suite's headline row marked
    REGRESSED when `regressed`; the names of those suites, sorted.
  """
  if not set(before) & set(after):
    raise ValueError(f"A and B share no suite (A: {sorted(before)}, B: {sorted(after)})")
  lines = [f"{'suite':<14}{'metric':<16}{'A':>10}{'B':>10}{'delta':>10}"]
  worse, notes = [], []
  for name in sorted(set(before) & set(after)):
    a, b = before[name], after[name]
    if ("bits_per_byte" in a) != ("bits_per_byte" in b):
      raise ValueError(f"suite {name}: one report is a perplexity report and the other is not")
    flag = regressed(a, b, threshold)
    worse += [name] if flag else []
    for row, (metric, x, y) in enumerate(_rows(a, b)):
      mark = "  REGRESSED" if flag and row == 0 else ""
      lines.append(f"{name:<14}{metric:<16}{x:>10.4f}{y:>10.4f}{y - x:>+10.4f}{mark}")
    if (a["tasks"], a.get("k")) != (b["tasks"], b.get("k")):
      notes.append(f"NOTE: {name}: A has {a['tasks']} tasks x {a.get('k', 1)}, B {b['tasks']} x {b.get('k', 1)}")
  for side, names in (("A", set(before) - set(after)), ("B", set(after) - set(before))):
    if names:
      notes.append(f"only in {side}: {', '.join(sorted(names))}")
  perplexity = any("bits_per_byte" in before[name] for name in set(before) & set(after))
  return "\n".join(lines + notes + [verdict(worse, threshold, perplexity)]), worse


def verdict(worse: Sequence[str], threshold: float, perplexity: bool = False) -> str:
  """The closing line of a comparison: the suites that regressed (`regressed`), or that none did.

  `perplexity`: perplexity reports were compared, by bits per byte.
  """
  rule = "pass@1 fell, or bits_per_byte rose," if perplexity else "pass@1 fell"
  if worse:
    return f"REGRESSED ({rule} by more than {threshold:g}): {', '.join(worse)}"
  return f"no regression (no {rule} by more than {threshold:g})"


def compare(a: Mapping[str, Any], b: Mapping[str, Any], *, tolerance: float = 0.0) -> str:
  """Returns a table of A vs B: pass@k, mean@k and outcome rates, regressions flagged.

  Args:
    a: the baseline report.
    b: the candidate report.
    tolerance: drops no larger than this are not flagged.

  Returns:
    The table, one metric per line; a pass@k or mean@k that fell by more than
    `tolerance`, or an "ok" rate that did, is marked REGRESSION (for
    perplexity reports: bits per byte, byte and token perplexity, bits per
    byte marked when it rose by more than `tolerance`).
  """
  if "bits_per_byte" in a or "bits_per_byte" in b:
    lines = [f"{'metric':<20}{'A':>10}{'B':>10}{'delta':>10}"]
    for row, (name, x, y) in enumerate(_rows(a, b)):
      flag = "  REGRESSION" if row == 0 and regressed(a, b, tolerance) else ""
      lines.append(f"{name:<20}{x:>10.4f}{y:>10.4f}{y - x:>+10.4f}{flag}")
    return "\n".join(lines)
  rows = [(f"pass@{j}", a["pass@k"].get(j), b["pass@k"].get(j)) for j in sorted(
      set(a["pass@k"]) | set(b["pass@k"]), key=int)]
  rows.append(("mean@k", a["mean@k"], b["mean@k"]))
  total_a, total_b = sum(a["outcomes"].values()) or 1, sum(b["outcomes"].values()) or 1
  for label in sorted(set(a["outcomes"]) | set(b["outcomes"])):
    rows.append((f"rate {label}", a["outcomes"].get(label, 0) / total_a, b["outcomes"].get(label, 0) / total_b))
  lines = [f"A: {a.get('env', '?')}, {a['tasks']} tasks x {a['k']}   "
           f"B: {b.get('env', '?')}, {b['tasks']} tasks x {b['k']}",
           f"{'metric':<20}{'A':>10}{'B':>10}{'delta':>10}"]
  for name, x, y in rows:
    if x is None or y is None:
      lines.append(f"{name:<20}{_cell(x)}{_cell(y)}")
      continue
    # Outcome rates other than "ok" are context: more timeouts need not be worse.
    watched = not name.startswith("rate ") or name == "rate ok"
    flag = "  REGRESSION" if watched and _fell(x, y, tolerance) else ""
    lines.append(f"{name:<20}{x:>10.4f}{y:>10.4f}{y - x:>+10.4f}{flag}")
  if a.get("sandbox") != b.get("sandbox"):
    lines.append(f"NOTE: scored by different sandbox backends (A: {a.get('sandbox')}, B: {b.get('sandbox')})")
  return "\n".join(lines)


def _cell(x: float | None) -> str:
  return f"{'-':>10}" if x is None else f"{x:>10.4f}"
