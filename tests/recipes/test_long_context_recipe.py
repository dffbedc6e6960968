"""The long-context SFT recipe: its tiny preset trains two steps with ring attention over seq=8."""

import json
import pathlib
import runpy

import pytest

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "recipes"
HEADER = ("Launch", "--distributed", "Topology", "Expected memory per chip", "Expected step time",
          "Expected scores", "Measured here", "python recipes/long_context_sft.py")


@pytest.fixture(autouse=True)
def recipes_importable(monkeypatch):
  # `python recipes/x.py` puts recipes/ first on sys.path; so does this.
  monkeypatch.syspath_prepend(str(RECIPES))


@pytest.mark.slow  # ring attention over 8 fake devices compiles for about a minute on 2 cores
def test_tiny_preset_runs_two_sequence_parallel_steps(tmp_path):
  recipe = runpy.run_path(str(RECIPES / "long_context_sft.py"), run_name="long_context_sft")
  summary = recipe["main"](["--preset", "tiny", "--out", str(tmp_path), "--no-progress", "--train.steps=2",
                            "--train.log_every=1"])
  assert summary["step"] == 2
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "loss" in r] == [1, 2]
  assert (tmp_path / "hf" / "config.json").exists(), "no HF export"
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["model"]["attention_impl"] == "ring" and config["mesh"]["seq"] == 8


def test_header_gives_launch_topology_memory_and_expectations():
  doc = runpy.run_path(str(RECIPES / "long_context_sft.py"), run_name="header")["__doc__"]
  missing = [word for word in HEADER if word not in doc]
  assert not missing, f"long_context_sft.py: header lacks {missing}"
