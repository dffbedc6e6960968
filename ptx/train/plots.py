"""PNG plots of a run: metric curves from `metrics.jsonl`, and before/after bar charts.

Every figure has a title, labelled axes with units and a legend. Figures are
built with matplotlib's object API (`Figure`, no pyplot), so writing a PNG
needs no display and never switches the backend of a notebook that imports
this module. Paths are local or gs:// (`ptx.paths`): a PNG is one file write.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

from matplotlib.figure import Figure

from ptx import paths


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
  """The records of a `metrics.jsonl`, in file order."""
  path = paths.path(path)
  records = []
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if line.strip():
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not a JSON object ({e})") from None
  return records


def plot_curves(records: Sequence[Mapping[str, float]], series: Mapping[str, str], path: str | os.PathLike, *,
                title: str, ylabel: str, xlabel: str = "training step") -> paths.Path:
  """Plots metrics against `step` as lines and writes a PNG.

  Args:
    records: logged records, each with a "step".
    series: metric key -> legend label; records without the key are skipped.
    path: the PNG to write (parent directories are created).
    title: the figure title.
    ylabel: the y-axis label, with its unit.
    xlabel: the x-axis label.

  Returns:
    `path`.

  Raises:
    ValueError: when no record has any of the keys (an empty plot says nothing).
  """
  fig = Figure(figsize=(7, 4), dpi=120)
  ax = fig.subplots()
  plotted = 0
  for key, label in series.items():
    points = [(r["step"], r[key]) for r in records if key in r]
    if points:
      steps, values = zip(*points)
      ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=label)
      plotted += 1
  if not plotted:
    raise ValueError(f"{paths.path(path).name}: no record has any of {sorted(series)}")
  ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
  ax.grid(alpha=0.3)
  ax.legend()
  return _save(fig, path)


def plot_stages(stages: Mapping[str, Mapping[str, float]], path: str | os.PathLike, *, title: str,
                ylabel: str = "accuracy (%)") -> paths.Path:
  """Grouped bars of fractions per stage (e.g. greedy / pass@1 / pass@8 before and after), shown in percent.

  Args:
    stages: stage name -> {metric name: fraction in [0, 1]}; every stage has the same metrics.
    path: the PNG to write.
    title: the figure title.
    ylabel: the y-axis label.

  Returns:
    `path`.
  """
  names = list(stages)
  metrics = list(next(iter(stages.values())))
  width = 0.8 / len(names)
  fig = Figure(figsize=(7, 4), dpi=120)
  ax = fig.subplots()
  for i, stage in enumerate(names):
    xs = [m + (i - (len(names) - 1) / 2) * width for m in range(len(metrics))]
    heights = [100 * stages[stage][metric] for metric in metrics]
    bars = ax.bar(xs, heights, width, label=stage)
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
  ax.set_xticks(range(len(metrics)), metrics)
  ax.set(title=title, ylabel=ylabel, ylim=(0, 105))
  ax.grid(axis="y", alpha=0.3)
  ax.legend()
  return _save(fig, path)


def _save(fig: Figure, path: str | os.PathLike) -> paths.Path:
  path = paths.path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  with path.open("wb") as f:
    fig.savefig(f, format="png")
  return path
