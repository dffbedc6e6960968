"""The side-by-side statistic: the median of per-run medians, taken alike for ptx and Tunix.

Every run of a compared benchmark, ptx's script or the Tunix harness, prints a JSON line holding
the median of its own timed steps (or calls) in seconds, at the same keys on both sides. A
`Comparison` names those keys, and the fields whose product is the tokens a step or call makes;
each run's figure is its tokens over its median seconds (or the seconds themselves for a step
time). The figure quoted is the median of the per-run figures, each side's, with the ratio ptx /
Tunix; the summary line lists every run's figure and process CPU seconds beside it.

Only the per-run medians are read: the harness's `tokens_per_s` and `gen_tokens_per_s` are means
over a run's steps, and until 12-01 they were set against ptx's medians. The harness takes a
run's median as `sorted(times)[n // 2]`, which is the median only for an odd n, so a compared run
times an odd number of steps (`check_odd`).

    .venv/bin/python benchmarks/run_medians.py OUT_DIR   # the summaries of a side_by_side.sh run
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import sys

SIDES = ("ptx", "tunix")


@dataclasses.dataclass(frozen=True)
class Comparison:
  """One compared figure: where each run's JSON line keeps its median seconds, CPU seconds and work."""
  part: str  # the summary line's name
  unit: str  # the figure's name in the summary: tokens_per_s, gen_tokens_per_s or step_s
  seconds: tuple[str, ...]  # keys down to the run's median seconds per step or call, the same on both sides
  cpu: tuple[str, ...]  # keys down to the run's process CPU seconds per step or call
  # Per side, the keys of the fields whose product is the tokens a step or call makes (the two sides
  # name them differently); empty when the figure is the step time itself.
  tokens: dict[str, tuple[tuple[str, ...], ...]] = dataclasses.field(default_factory=dict)


SFT = Comparison("sft_summary", "tokens_per_s", ("sft", "step_s_median"), ("sft", "cpu_s_per_step"),
                 {side: (("sft", "batch"), ("sft", "seq_len")) for side in SIDES})
SAMPLING = Comparison("anchor_summary", "gen_tokens_per_s", ("call_s_median",), ("cpu_s_per_call",),
                      {"ptx": (("rows",), ("new_tokens",)), "tunix": (("batch",), ("gen_len",))})
GRPO = Comparison("summary", "step_s", ("step_s_median",), ("cpu_s_per_step",))


def _at(line: dict, keys: tuple[str, ...]):
  """The value at `keys`, one level of the JSON line each."""
  for key in keys:
    line = line[key]
  return line


def run_figure(comparison: Comparison, line: dict) -> float:
  """One run's figure from its JSON line: its tokens over its median seconds, or the median seconds."""
  seconds = _at(line, comparison.seconds)
  if not comparison.tokens:
    return seconds
  return math.prod(_at(line, keys) for keys in comparison.tokens[line["framework"]]) / seconds


def summary(comparison: Comparison, lines: list[dict]) -> dict:
  """The comparison's closing line from every run's JSON line (lines without a `framework` are skipped).

  Returns:
    Per side: the number of runs, every run's figure and CPU seconds, and the median of the
    per-run figures; and `ratio`, ptx's median over Tunix's.
  """
  digits = 1 if comparison.tokens else 4
  out = {"part": comparison.part, "statistic": "median of per-run medians"}
  medians = {}
  for side in SIDES:
    runs = [line for line in lines if line.get("framework") == side]
    figures = [run_figure(comparison, line) for line in runs]
    medians[side] = statistics.median(figures)
    out[f"{side}_runs"] = len(runs)
    out[f"{side}_{comparison.unit}_per_run"] = [round(x, digits) for x in figures]
    out[f"{side}_cpu_s_per_run"] = [round(_at(line, comparison.cpu), 4) for line in runs]
    out[f"{side}_{comparison.unit}"] = round(medians[side], digits)
  out["ratio"] = round(medians["ptx"] / medians["tunix"], 3)
  return out


def check_odd(count: int, flag: str) -> None:
  """Refuses an even number of timed steps for a compared run: the harness's median would be the upper one."""
  if count % 2 == 0:
    raise SystemExit(f"{flag}={count}: a run compared with Tunix times an odd number of steps, for which the "
                     "harness's sorted(times)[n // 2] is the median")


def _lines(path: pathlib.Path) -> list[dict]:
  """Every JSON line of a benchmark's log."""
  return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def main(argv: list[str]) -> None:
  """Prints the SFT, sampling and GRPO summaries of a side_by_side.sh output folder, one JSON line each."""
  out = pathlib.Path(argv[0])
  train = [line for pattern in ("train_ptx_[0-9].log", "train_tunix_*.log") for path in sorted(out.glob(pattern))
           for line in _lines(path)]
  scan = _lines(out / "train_ptx_scan.log")[-1]
  print(json.dumps({**summary(SFT, train), "ptx_scan_layers_tokens_per_s": round(run_figure(SFT, scan), 1)}))
  print(json.dumps(summary(SAMPLING, _lines(out / "sampling.log"))))
  print(json.dumps(summary(GRPO, _lines(out / "grpo.log"))))


if __name__ == "__main__":
  main(sys.argv[1:])
