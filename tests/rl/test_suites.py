"""ptx.rl.suites: generated and file suites load and evaluate."""

import json

import pytest

from ptx.rl import evaluation, suites


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_generated_suites_are_seeded(name):
  env, tasks = suites.load(name, n=5, seed=2)
  assert len(tasks) == 5 and tasks == suites.load(name, n=5, seed=2)[1] != suites.load(name, n=5, seed=3)[1]
  assert env.reset(tasks[0]).prompt


def test_math_file_suite_evaluates(tmp_path):
  path = tmp_path / "math.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"{i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(3)))
  env, tasks = suites.load("math", n=10, path=path)
  assert len(tasks) == 3 and env.reset(tasks[0]).prompt.endswith("\\boxed{}.")
  report = evaluation.evaluate(lambda prompts, k: [[f"\\boxed{{{2 * int(p.split('+')[0])}}}"] * k for p in prompts],
                               env, tasks, k=2)
  assert report["pass@k"] == {"1": 1.0, "2": 1.0}


def test_bad_names_and_missing_paths_are_explained():
  with pytest.raises(ValueError, match="known: arithmetic"):
    suites.load("nope")
  with pytest.raises(ValueError, match="pass path"):
    suites.load("code")


def test_a_suite_report_names_its_suite_and_needle_reads_per_cell():
  env, tasks = suites.load("arithmetic", n=2)
  report = suites.evaluate("arithmetic", env, tasks, lambda prompts, k: [["no idea"] * k for _ in prompts], k=2)
  assert report["suite"] == "arithmetic" and report["tasks"] == 2 and "cells" not in report
  env, tasks = suites.load("needle", n=3)
  report = suites.evaluate("needle", env, tasks, lambda prompts, k: [["no idea"] * k for _ in prompts], k=1)
  want = {(str(t["length"]), str(t["depth"])) for t in tasks}
  got = {(length, depth): v for length, row in report["cells"].items() for depth, v in row.items()}
  assert report["suite"] == "needle" and set(got) == want and set(got.values()) == {0.0}
