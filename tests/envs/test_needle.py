"""Needle retrieval: the (length, depth) grid, scoring, and accuracy per cell."""

import pytest

from ptx.episodes import evaluation

from ptx.envs import suites
from ptx.envs.needle import NeedleEnv, NeedleTask, cells


def test_tasks_place_the_needle_at_the_asked_depth_and_length():
  tasks = NeedleTask(seed=1, lengths=(100, 400), depths=(0.0, 0.5, 1.0))
  for i in range(6):
    task = tasks[i]
    words = task["prompt"].split("\n\n")[0].split()
    at = next(j for j, w in enumerate(words) if w == task["answer"] + ".")
    assert len(words) == task["length"] + 7  # the needle sentence is 7 words
    assert at - 6 == round(task["depth"] * task["length"])
  assert [(t["length"], t["depth"]) for t in (tasks[i] for i in range(6))] == [
      (100, 0.0), (100, 0.5), (100, 1.0), (400, 0.0), (400, 0.5), (400, 1.0)]
  assert tasks[0] != tasks[6] and (tasks[0]["length"], tasks[0]["depth"]) == (tasks[6]["length"], tasks[6]["depth"])
  with pytest.raises(ValueError, match="depths"):
    NeedleTask(depths=(1.5,))


def test_suite_reports_accuracy_per_cell():
  env, tasks = suites.load("needle", n=30, seed=0)
  assert isinstance(env, NeedleEnv) and len(tasks) == 30

  def generate(prompts, k):
    # Finds the needle only in the first half of each haystack.
    out = []
    for p, t in zip(prompts, tasks):
      out.append([f"It is {t['answer']}." if t["depth"] <= 0.5 else "It is 42."] * k)
    return out

  report = evaluation.evaluate(generate, env, tasks, k=2)
  table = cells(report, tasks)
  assert set(table) == {"1000", "4000", "16000"}
  assert table["4000"] == {"0.0": 1.0, "0.25": 1.0, "0.5": 1.0, "0.75": 0.0, "1.0": 0.0}
  assert report["outcomes"] == {"ok": 36, "wrong": 24}
  assert env.reset(tasks[0]).step("no digits here").outcome == "no_answer"
