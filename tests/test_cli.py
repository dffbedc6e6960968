"""The `ptx` command line: help, version, demo, override errors."""

import json
import shlex
import subprocess
import sys

import pytest

from cli_runs import SFT, SFT_STEPS, by_step, files_flag, metrics, write_jsonl
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


def test_sft_and_dpo_commands_train_from_jsonl(tmp_path, capsys):
  sft_file = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(64)])
  pref_file = write_jsonl(tmp_path / "pref.jsonl", [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "no"}
                                                   for i in range(64)])
  cli.main(["sft", "--out", str(tmp_path / "sft"), files_flag("train_files", sft_file),
            files_flag("eval_files", sft_file), f"--train.eval_every={SFT_STEPS}", *SFT])
  records = metrics(tmp_path / "sft")
  assert any("eval/loss" in r for r in records) and records[-1]["step"] == SFT_STEPS
  assert list((tmp_path / "sft" / "tensorboard").iterdir()), "no TensorBoard event file"
  assert (tmp_path / "sft" / "hf" / "config.json").is_file(), "a finished run exports its model unless --no-export"
  # With a held-out suite evaluated before the first step and after the last (`ptx.train.checkpoint_evals`).
  common = ["--no-progress", "--model=tiny", "--model.n_layers=1", "--train.steps=4", "--train.log_every=2",
            "--data.batch_size=8", "--data.seq_len=32", "--mesh.data=2", "--mesh.fsdp=4"]
  cli.main(["dpo", "--out", str(tmp_path / "dpo"), files_flag("train_files", pref_file), *common,
            '--eval.suites=["arithmetic"]', "--eval.n=2", "--eval.k=1", "--eval.max_new_tokens=2"])
  evaluated = [r["step"] for r in metrics(tmp_path / "dpo") if "eval/arithmetic/pass@1" in r]
  assert evaluated == [0, 4] and (tmp_path / "dpo" / "evals" / "step_4" / "arithmetic" / "eval.json").is_file()
  # The last step's training line (its evaluation's line follows it).
  last = [r for r in metrics(tmp_path / "dpo") if "loss" in r][-1]
  assert last["step"] == 4 and {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                                "logps/chosen", "logps/rejected"} <= set(last)
  # A saved config.json is a valid --config file, and overrides apply on top of it.
  capsys.readouterr()
  cli.main(["sft", "--config", str(tmp_path / "sft" / "config.json"), "--out", str(tmp_path / "again"),
            "--train.log_every=3", "--no-progress", "--no-export"])
  assert json.loads((tmp_path / "again" / "config.json").read_text())["model"]["n_layers"] == 1
  assert sorted(by_step(tmp_path / "again")) == [3, 6]
  assert '"summary"' in capsys.readouterr().out
  assert not (tmp_path / "again" / "hf").exists(), "--no-export wrote a model"


def test_sft_without_data_is_a_clear_error(capsys):
  with pytest.raises(SystemExit):
    cli.main(["sft", "--model=tiny"])
  assert "--data.train_files" in capsys.readouterr().err


def test_fields_lists_what_the_command_would_run_with_as_override_lines(tmp_path, capsys):
  from ptx import config_io
  from ptx.config import Config
  from ptx.train import presets

  out = tmp_path / "run"
  assert cli.main(["grpo", "--out", str(out), "--fields", "--train.steps=7", "--grpo.group_size=4"]) == 0
  lines = [word for line in capsys.readouterr().out.splitlines() for word in shlex.split(line)]  # shell-quoted
  assert not out.exists(), "--fields wrote into --out"
  assert "--train.steps=7" in lines and "--grpo.group_size=4" in lines and '--eval.suites=[]' in lines
  # The job's sections and eval only, every field once; passed back, they rebuild the config of the run.
  sections = {line[2:].split(".")[0] for line in lines}
  assert sections == {"model", "mesh", "optim", "train", "data", "grpo", "lora", "rollout", "eval"}
  want = config_io.apply_overrides(presets.TOY["grpo"](), ["--train.steps=7", "--grpo.group_size=4"])
  got = config_io.apply_overrides(Config(), lines)
  assert all(getattr(got, s) == getattr(want, s) for s in sections)
  # From a saved config, and with --model-dir the fine-tuning preset (nothing is read from the directory).
  (tmp_path / "config.json").write_text(config_io.dumps(want))
  assert cli.main(["sft", "--config", str(tmp_path / "config.json"), "--fields"]) == 0
  assert "--train.steps=7" in capsys.readouterr().out.splitlines()
  assert cli.main(["sft", "--model-dir", str(tmp_path / "absent"), "--fields"]) == 0
  finetune = presets.FINETUNE["sft"]()
  assert f"--optim.warmup_steps={finetune.optim.warmup_steps}" in capsys.readouterr().out.splitlines()
  # A bad override is refused as a run would refuse it.
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["dpo", "--fields", "--dpo.beta=x"])
  assert exit_info.value.code == 2 and "dpo.beta: expected float" in capsys.readouterr().err
