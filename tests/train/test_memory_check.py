"""The memory check before the first step: a step over the limit is refused up front, and its estimate is XLA's."""

import pytest

from cli_runs import SFT, SFT_STEPS, by_step, exit_code, files_flag, write_jsonl
from ptx import cli
from ptx.train import memory_check


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
  rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(200)]
  return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", rows)


def _argv(out, train_file, *extra):
  """`ptx sft` of the shared SFT shape into `out`."""
  return ["sft", "--out", str(out), files_flag("train_files", train_file), *SFT, *extra]


def test_a_step_over_the_limit_is_refused_before_step_1_and_the_same_command_then_runs(train_file, tmp_path, capsys,
                                                                                      monkeypatch):
  out = tmp_path / "run"
  with monkeypatch.context() as patch:
    patch.setattr(memory_check, "available", lambda mesh: (4_000_000, "allowed by this test"))
    assert exit_code(_argv(out, train_file)) == 1
  err = capsys.readouterr().err
  # One message: the estimate, the limit and where it was read, then the settings that size a step, with values.
  assert err.startswith("ptx sft: error: a step needs about ") and "over 8 devices of the 4.0 MB allowed by this" in err
  for setting in ("data.batch_size=8 rows of data.seq_len=32", "train.grad_accum, now 1",
                  "model.remat=full (now 'none'", "model.logits_chunk", "--lora.rank=16", "train.memory_check=false"):
    assert setting in err, setting
  assert "Traceback" not in err
  assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
  assert exit_code(_argv(out, train_file)) == 0  # the same command, with the machine's own limit
  printed = capsys.readouterr().out
  assert "held a run that stopped before its first metrics line" in printed
  assert "memory check: a step needs about" in printed
  assert sorted(by_step(out)) == list(range(1, SFT_STEPS + 1))


def test_the_estimate_is_read_from_the_compiled_step_and_grows_with_the_batch(train_file, tmp_path, monkeypatch):
  class Measured(Exception):
    """Stops the run once the check has measured, before any state is allocated."""

  estimates, check = [], memory_check.check

  def measure_then_stop(*args, **kwargs):
    estimates.append(check(*args, **kwargs))
    raise Measured

  monkeypatch.setattr(memory_check, "check", measure_then_stop)
  for rows in (8, 16):
    with pytest.raises(Measured):
      cli.main(_argv(tmp_path / str(rows), train_file, f"--data.batch_size={rows}"))
  (small, large) = (e.footprint.programs["step"] for e in estimates)
  assert estimates[0].footprint.state == estimates[1].footprint.state > 0
  # XLA's argument sizes: each device holds 1, then 2 of the batch's rows.
  assert large.inputs == 2 * small.inputs > 0
  assert large.temp > small.temp > 0
  assert estimates[1].need > estimates[0].need and estimates[0].devices == 8
