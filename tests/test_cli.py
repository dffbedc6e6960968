"""The `ptx` command line: help, version, demo, override errors."""

import json
import subprocess
import sys

import pytest

from ptx import cli


def test_help_lists_the_commands(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  assert "version" in out and "demo" in out


def test_version(capsys):
  assert cli.main(["version"]) == 0
  assert capsys.readouterr().out.startswith("ptx 0.1.0 (jax ")


def test_console_script_is_installed():
  out = subprocess.run([sys.executable, "-m", "ptx.cli", "version"], capture_output=True, text=True, check=True)
  assert out.stdout.startswith("ptx ")


def test_bad_override_names_the_field(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["demo", "--model.d_modle=3"])
  assert exit_info.value.code == 2
  assert "unknown field 'd_modle'" in capsys.readouterr().err


def test_demo_trains_and_writes_its_outputs(tmp_path, capsys):
  out = tmp_path / "demo"
  cli.main(["demo", "--out", str(out), "--no-progress", "--train.steps=40", "--train.log_every=20",
            "--data.batch_size=16", "--mesh.data=2", "--mesh.fsdp=4"])
  config = json.loads((out / "config.json").read_text())
  assert config["train"]["steps"] == 40 and config["mesh"]["data"] == 2
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [20, 40]
  assert records[-1]["loss"] < records[0]["loss"]
  assert {"loss", "accuracy", "grad_norm", "lr", "tokens_per_s"} <= set(records[0])
  printed = capsys.readouterr().out
  assert '"steps": 40' in printed and "held-out exact match" in printed
