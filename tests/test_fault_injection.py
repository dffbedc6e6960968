"""Faults a user meets, injected into real `ptx sft` runs: each ends in its error or its recovery, and loses nothing.

Every case drives the command line (`ptx.cli.main`, in this process so the
programs compile once) on a one-layer model, and checks the exact message
and that the earlier run's checkpoints, metrics, config and export are
byte-for-byte what they were. The bad-input cases (empty datasets, records
too long, truncated shards, vocabulary mismatches) are in
tests/test_fault_injection_inputs.py.
"""

import errno
import hashlib
import json
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from cli_runs import SFT, SFT_STEPS as STEPS, exit_code, files_flag, metrics


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "train.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "completion": str(2 * i)}) + "\n" for i in range(200)))
  return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, train_file):
  """A completed run (checkpoints at 2, 4, 6, metrics, export); tests work on copies of it."""
  out = tmp_path_factory.mktemp("finished") / "run"
  assert _sft(out, train_file) == 0
  return out


def _sft(out, train_file, *extra):
  """The exit code of `ptx sft` (2 for a refusal, whether argparse's or the run's)."""
  return exit_code(["sft", "--out", str(out), files_flag("train_files", train_file), *SFT, *extra])


def _copy(run, tmp_path):
  target = tmp_path / "run"
  shutil.copytree(run, target)
  return target


def _digest(out: pathlib.Path) -> dict[str, str]:
  """SHA-256 of every file under `out`: what must survive a refused or failed command unchanged."""
  return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(out.rglob("*")) if p.is_file()}


def _flip_bytes(path: pathlib.Path, count: int = 64) -> None:
  data = bytearray(path.read_bytes())
  middle = len(data) // 2
  for i in range(middle, middle + count):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def _largest_array_file(step_dir: pathlib.Path) -> pathlib.Path:
  return max((p for p in (step_dir / "state").rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_flipped_bytes_in_a_checkpoint_are_detected_and_never_trained_on(finished_run, train_file, tmp_path,
                                                                          capsys, caplog):
  out = _copy(finished_run, tmp_path)
  _flip_bytes(_largest_array_file(out / "checkpoints" / "6"))
  assert _sft(out, train_file, "--resume", "--train.steps=8") == 0
  stdout = capsys.readouterr().out
  assert "resumed from checkpoint step 4" in stdout
  # The arrays are stored zstd-compressed, and which chunk lies mid-file changes with the order of the
  # asynchronous writes: a flipped block that no longer decodes is the reader's error, one that decodes to
  # other numbers is the checksums'. Either is damage; the next test pins the checksums' path alone.
  assert "checkpoint step 6 is damaged" in caplog.text, caplog.text
  assert (out / "checkpoints.damaged" / "6").is_dir(), "the damaged step was not kept aside"
  assert [r["step"] for r in metrics(out)] == list(range(1, 9)), "metrics must read as one run"
  assert all(np.isfinite(r["loss"]) for r in metrics(out))


def test_arrays_that_read_back_cleanly_but_are_not_what_was_written_are_caught_by_the_checksums(
    finished_run, train_file, tmp_path, capsys, caplog):
  out = _copy(finished_run, tmp_path)
  # Step 4's arrays under step 6's name: every file decodes, only the values are wrong.
  state = out / "checkpoints" / "6" / "state"
  shutil.rmtree(state)
  shutil.copytree(out / "checkpoints" / "4" / "state", state)
  assert _sft(out, train_file, "--resume", "--train.steps=8") == 0
  assert "resumed from checkpoint step 4" in capsys.readouterr().out
  assert "checkpoint step 6 is damaged" in caplog.text and "differ from the checksums" in caplog.text
  assert ".step" in caplog.text and ".params['embed']" in caplog.text, caplog.text
  assert (out / "checkpoints.damaged" / "6").is_dir()
  assert [r["step"] for r in metrics(out)] == list(range(1, 9))


def test_a_run_whose_every_checkpoint_is_damaged_stops_and_exports_nothing(finished_run, train_file, tmp_path,
                                                                            capsys):
  out = _copy(finished_run, tmp_path)
  for step in (2, 4, 6):
    _flip_bytes(_largest_array_file(out / "checkpoints" / str(step)))
  before = _digest(out / "hf")
  assert _sft(out, train_file, "--resume", "--train.steps=8") == 1
  err = capsys.readouterr().err
  assert "can be restored; every one is damaged" in err and "step 2:" in err and "step 6:" in err
  assert _digest(out / "hf") == before, "the earlier export was written over"


def test_a_restore_error_that_is_not_damage_stops_the_run_and_moves_nothing(finished_run, train_file, tmp_path,
                                                                             monkeypatch):
  out = _copy(finished_run, tmp_path)
  before = _digest(out)

  def transient(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error (injected)")

  monkeypatch.setattr(ocp.CheckpointManager, "restore", transient)
  with pytest.raises(OSError, match="injected"):
    _sft(out, train_file, "--resume")
  assert not (out / "checkpoints.damaged").exists()
  after = _digest(out)
  assert {k: v for k, v in after.items() if not k.startswith("tensorboard")} == \
      {k: v for k, v in before.items() if not k.startswith("tensorboard")}


def test_rerunning_into_a_run_directory_without_resume_is_refused(finished_run, train_file, tmp_path, capsys):
  out = _copy(finished_run, tmp_path)
  before = _digest(out)
  assert _sft(out, train_file) == 2
  err = capsys.readouterr().err
  assert "holds an earlier run" in err and "pass --resume to continue it, --overwrite to replace it" in err
  assert _digest(out) == before, "a refused command changed the run directory"
  # --overwrite replaces it: a fresh run of the same length (the same programs), no trace of the old one.
  (out / "checkpoints" / "4" / "marker").write_text("old")
  shutil.copytree(out / "checkpoints" / "6", out / "checkpoints" / "8")  # as if the old run had been longer
  assert _sft(out, train_file, "--overwrite") == 0
  assert [r["step"] for r in metrics(out)] == list(range(1, STEPS + 1)), "the old run's metrics were kept"
  assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4, 6]
  assert not (out / "checkpoints" / "4" / "marker").exists()


def test_out_of_memory_in_the_first_step_names_the_settings_and_does_not_block_the_rerun(train_file, tmp_path, capsys,
                                                                                         monkeypatch):
  from ptx.train.step import JittedStep

  out = tmp_path / "run"
  (out / "pretrained").mkdir(parents=True)  # a cache of the failed start's config: the rerun must not trust it

  def out_of_memory(self, state, batch):  # what XLA raised for the README's fine-tune line on this machine
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 49491611192 bytes.")

  capsys.readouterr()
  with monkeypatch.context() as patch:
    patch.setattr(JittedStep, "__call__", out_of_memory)
    assert _sft(out, train_file) == 1
  # One message, no traceback: what ran out and the settings that size a step, with their values.
  err = capsys.readouterr().err
  assert err.startswith("ptx sft: error: out of device memory (RESOURCE_EXHAUSTED: Out of memory allocating"), err
  assert "data.batch_size=8 rows of data.seq_len=32 tokens" in err and "model.remat=full (now 'none'" in err
  assert "--lora.rank=16" in err and "Traceback" not in err
  assert (out / "config.json").exists() and not metrics(out), "the failed start left more than its config"
  assert _sft(out, train_file) == 0  # the same command again: neither --resume nor --overwrite
  assert "held a run that stopped before its first metrics line and checkpoint" in capsys.readouterr().out
  assert [r["step"] for r in metrics(out)] == list(range(1, STEPS + 1)) and not (out / "pretrained").exists()


def test_resume_with_a_changed_model_is_refused_with_the_differing_fields(finished_run, train_file, tmp_path,
                                                                           capsys):
  out = _copy(finished_run, tmp_path)
  before = _digest(out)
  assert _sft(out, train_file, "--resume", "--model.d_model=96", "--data.seed=3") == 2
  err = capsys.readouterr().err
  assert "model.d_model: 64 in the run, 96 now" in err and "data.seed: 0 in the run, 3 now" in err
  assert "Event loop is closed" not in err
  assert _digest(out) == before, "config.json or the checkpoints were written over"
  # Fields on the documented list may change: a longer run, logged less often.
  assert _sft(out, train_file, "--resume", "--train.steps=8", "--train.log_every=2") == 0
  assert [r["step"] for r in metrics(out)][-2:] == [6, 8]


def test_a_torn_last_metrics_line_is_repaired_on_resume(finished_run, train_file, tmp_path, capsys):
  out = _copy(finished_run, tmp_path)
  # What a process killed inside step 5's write leaves: lines up to step 4, half of step 5's, and no
  # checkpoint after step 4 (step 6's is written after its log line).
  shutil.rmtree(out / "checkpoints" / "6")
  lines = (out / "metrics.jsonl").read_text().splitlines()
  (out / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4][: len(lines[4]) // 2])
  assert _sft(out, train_file, "--resume") == 0
  assert "dropped its torn last line 5" in capsys.readouterr().out
  assert [r["step"] for r in metrics(out)] == list(range(1, STEPS + 1))


def test_a_damaged_metrics_line_before_the_last_stops_resume_and_names_it(finished_run, train_file, tmp_path,
                                                                           capsys):
  out = _copy(finished_run, tmp_path)
  lines = (out / "metrics.jsonl").read_text().splitlines()
  lines[1] = lines[1][:10]
  (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  before = _digest(out)
  assert _sft(out, train_file, "--resume") == 2
  assert f"{out / 'metrics.jsonl'}:2: not a metrics record" in capsys.readouterr().err
  assert _digest(out) == before


def test_a_diverging_run_stops_non_zero_keeps_the_last_finite_checkpoint_and_exports_nothing(train_file, tmp_path,
                                                                                             capsys):
  out = tmp_path / "run"
  code = _sft(out, train_file, "--optim.lr=1e30", "--optim.warmup_steps=0", "--train.steps=20",
              "--train.max_nonfinite_steps=4", "--train.checkpoint_every=1")
  assert code == 1
  err = capsys.readouterr().err
  assert "diverged: the last 4 optimizer steps" in err and "train.max_nonfinite_steps=4" in err
  assert not (out / "hf").exists(), "a diverged run exported its parameters"
  records = metrics(out)
  streaks = {r["step"]: r["nonfinite_streak"] for r in records}
  first_bad = min(step for step, streak in streaks.items() if streak > 0)
  kept = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
  assert kept and all(step < first_bad for step in kept), f"checkpoints {kept}; the streak began at {first_bad}"
  assert f"the newest checkpoint kept is step {kept[-1]}" in err
  assert max(streaks) < 20, "the run went on after the limit"
