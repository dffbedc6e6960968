"""Run directories: an earlier run is refused, replaced in two steps, and a resume may change only the listed fields."""

import json

import pytest

from ptx import config_io
from ptx.config import Config, TrainConfig
from ptx.train import run_dir


def test_an_earlier_run_is_refused_and_nothing_is_touched(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "data.jsonl").write_text("{}\n")
  with pytest.raises(run_dir.RunDirError, match="holds an earlier run \\(checkpoints\\): pass --resume"):
    run_dir.check(tmp_path, resume=False, overwrite=False)
  with pytest.raises(run_dir.RunDirError, match="pass one"):
    run_dir.check(tmp_path, resume=True, overwrite=True)
  run_dir.check(tmp_path, resume=True, overwrite=False)
  run_dir.check(tmp_path, resume=False, overwrite=True)
  run_dir.check(tmp_path / "fresh", resume=False, overwrite=False)  # no directory yet: nothing to refuse
  assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "data.jsonl"]


def test_clearing_results_keeps_data_and_caches(tmp_path):
  for name in ("config.json", "metrics.jsonl", "data.jsonl"):
    (tmp_path / name).write_text("x")
  for name in ("checkpoints", "hf", "reference_logps", "pretrained"):
    (tmp_path / name).mkdir()
  run_dir.clear(tmp_path, run_dir.RESULTS)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "pretrained", "reference_logps"]
  run_dir.clear(tmp_path, run_dir.CACHES)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]
  assert not set(run_dir.CACHES) & set(run_dir.RESULTS)


def test_resume_may_change_only_the_resumable_fields(tmp_path):
  saved = json.loads(json.dumps(config_io.to_dict(Config())))
  longer = Config(train=TrainConfig(steps=900, log_every=1, eval_every=7))
  run_dir.check_resume(saved, config_io.to_dict(longer), tmp_path)
  reseeded = Config(train=TrainConfig(seed=5))
  with pytest.raises(run_dir.RunDirError, match=r"train.seed: 0 in the run, 5 now"):
    run_dir.check_resume(saved, config_io.to_dict(reseeded), tmp_path)


def test_a_damaged_saved_config_is_named(tmp_path):
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(run_dir.RunDirError, match="config.json: not valid JSON"):
    run_dir.saved_config(tmp_path)
  assert run_dir.saved_config(tmp_path / "none") is None


def test_a_refusal_judged_by_process_0_reaches_the_caller(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
  with pytest.raises(run_dir.RunDirError, match="holds an earlier run"):
    run_dir.agreed(lambda: run_dir.check(tmp_path, resume=False, overwrite=False))
  run_dir.agreed(lambda: run_dir.check(tmp_path, resume=True, overwrite=False))


def test_a_run_that_stopped_before_its_first_metrics_line_and_checkpoint_is_replaced_by_a_new_start(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  (tmp_path / "metrics.jsonl").write_text("")
  (tmp_path / "checkpoints" / "1.orbax-checkpoint-tmp-5").mkdir(parents=True)  # a save that never finished
  assert run_dir.failed_start(tmp_path)
  run_dir.check(tmp_path, resume=False, overwrite=False)
  assert run_dir.replaces(tmp_path, resume=False, overwrite=False)
  assert not run_dir.replaces(tmp_path, resume=True, overwrite=False)  # a resume keeps what there is
  # A metrics line, or a published checkpoint, is an earlier run: refused, and never replaced unasked.
  for made in ("metrics", "checkpoint"):
    if made == "metrics":
      (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    else:
      (tmp_path / "metrics.jsonl").write_text("")
      (tmp_path / "checkpoints" / "2").mkdir()
    assert not run_dir.failed_start(tmp_path) and not run_dir.replaces(tmp_path, resume=False, overwrite=False)
    with pytest.raises(run_dir.RunDirError, match="holds an earlier run"):
      run_dir.check(tmp_path, resume=False, overwrite=False)
  assert not run_dir.failed_start(tmp_path / "fresh") and not run_dir.failed_start(tmp_path / "checkpoints")
