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


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_sft_and_dpo_commands_train_from_jsonl(tmp_path, capsys):
  sft_file = _jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(64)])
  pref_file = _jsonl(tmp_path / "pref.jsonl", [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "no"}
                                              for i in range(64)])
  common = ["--no-progress", "--model=tiny", "--model.n_layers=1", "--train.steps=4", "--train.log_every=2",
            "--data.batch_size=8", "--data.seq_len=32", "--mesh.data=2", "--mesh.fsdp=4"]
  cli.main(["sft", "--out", str(tmp_path / "sft"), f"--data.train_files=[\"{sft_file}\"]",
            f"--data.eval_files=[\"{sft_file}\"]", "--train.eval_every=4", *common])
  records = [json.loads(l) for l in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
  assert any("eval/loss" in r for r in records) and records[-1]["step"] == 4
  assert list((tmp_path / "sft" / "tensorboard").iterdir()), "no TensorBoard event file"
  # With a held-out suite evaluated before the first step and after the last (`ptx.train.checkpoint_evals`).
  cli.main(["dpo", "--out", str(tmp_path / "dpo"), f"--data.train_files=[\"{pref_file}\"]", *common,
            '--eval.suites=["arithmetic"]', "--eval.n=2", "--eval.k=1", "--eval.max_new_tokens=2"])
  evaluated = [r["step"] for r in map(json.loads, (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines())
               if "eval/arithmetic/pass@1" in r]
  assert evaluated == [0, 4] and (tmp_path / "dpo" / "evals" / "step_4" / "arithmetic" / "eval.json").is_file()
  # The last step's training line (its evaluation's line follows it).
  lines = (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()
  last = [r for r in map(json.loads, lines) if "loss" in r][-1]
  assert last["step"] == 4 and {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                                "logps/chosen", "logps/rejected"} <= set(last)
  # A saved config.json is a valid --config file.
  cli.main(["sft", "--config", str(tmp_path / "sft" / "config.json"), "--out", str(tmp_path / "again"),
            "--train.steps=2", "--no-progress"])
  assert json.loads((tmp_path / "again" / "config.json").read_text())["model"]["n_layers"] == 1
  assert '"summary"' in capsys.readouterr().out


def test_sft_without_data_is_a_clear_error(capsys):
  with pytest.raises(SystemExit):
    cli.main(["sft", "--model=tiny"])
  assert "--data.train_files" in capsys.readouterr().err
