"""The training job: exact resume after SIGKILL and SIGTERM, damaged checkpoints, non-finite steps."""

import contextlib
import io
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cli_runs import (SFT, SFT_STEPS, by_step, checkpoint_params, cut_after, files_flag, metrics, signalling_step,
                      summary, without_timing)
from ptx import cli
from ptx.algorithms import sft
from ptx import config_io
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.tokenizer import ByteTokenizer
from ptx.sharding import make_mesh
from ptx.train import loop, presets
from ptx.train.job import sft_job
from ptx.train.state import init_state, state_shardings
from ptx.train.step import JittedStep, make_train_step

TESTS = pathlib.Path(__file__).resolve().parents[1]
# Run as `python -c SCRIPT TESTS OUT AT WAIT CLI-ARGS...`: the CLI, its step patched to SIGKILL the process as step AT
# begins, once checkpoint WAIT is published.
_KILLED_AS_A_STEP_BEGINS = """
import pathlib, signal, sys
sys.path.insert(0, sys.argv[1])
from cli_runs import signalling_step
from ptx import cli
from ptx.train.step import JittedStep
out, at, wait = pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
JittedStep.__call__ = signalling_step(JittedStep.__call__, out, at=at, wait=wait, signum=signal.SIGKILL)
sys.exit(cli.main(sys.argv[5:]))
"""


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
  """600 SFT records of 3-digit addition and multiplication."""
  path = tmp_path_factory.mktemp("data") / "train.jsonl"
  task = ArithmeticTask(0, 3, "+*")
  path.write_text("".join(json.dumps({"prompt": task[i]["prompt"], "completion": task[i]["answer"]}) + "\n"
                          for i in range(600)))
  return path


def _argv(out, train_file, *extra):
  """`ptx sft` of the run into `out`."""
  return ["sft", "--out", str(out), files_flag("train_files", train_file), *SFT, *extra]


def _checkpoints(out):
  """The steps of `out`'s published checkpoints."""
  return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


def _in_process(argv):
  """(exit code, printed summary) of `ptx ARGV` run in this process."""
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    code = cli.main(argv)
  return code, summary(stdout.getvalue())


def _killed(argv, *, at, wait):
  """The stdout of `ptx ARGV` (a run into argv[2]) in a process SIGKILLed as step `at` begins, once checkpoint
  `wait` is published."""
  killed = subprocess.run([sys.executable, "-c", _KILLED_AS_A_STEP_BEGINS, str(TESTS), argv[2], str(at), str(wait),
                           *argv], capture_output=True, text=True)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  return killed.stdout


@pytest.fixture(scope="module")
def finished_run(train_file, tmp_path_factory):
  """The run uninterrupted: checkpoints 2, 4 and 6, and metrics."""
  out = tmp_path_factory.mktemp("finished") / "run"
  assert cli.main(_argv(out, train_file, "--no-export")) == 0
  return out


@pytest.fixture(scope="module")
def interrupted(finished_run, train_file, tmp_path_factory):
  """The same run, checkpointed every 3 steps, killed, resumed and killed, resumed and preempted, then resumed to its
  end: what each stage left and printed. (A step's metrics line is written once the next step is queued, so a line
  lies past the newest checkpoint only two steps after it.) The finished run comes first: its programs, compiled in
  this process, reach the killed processes through the persistent compile cache."""
  out, seen = tmp_path_factory.mktemp("interrupted") / "run", {}
  argv = lambda *extra: _argv(out, train_file, "--train.checkpoint_every=3", *extra)
  # Killed as step 4 begins, once checkpoint 3 is published.
  _killed(argv(), at=4, wait=3)
  seen["first kill"] = ([r["step"] for r in metrics(out)], _checkpoints(out))
  # Resumed, then killed as step 6 begins: step 4's line was written after the newest checkpoint, 3.
  stdout = _killed(argv("--resume"), at=6, wait=3)
  seen["second kill"] = (stdout, [r["step"] for r in metrics(out)], _checkpoints(out))
  # Resumed, then a SIGTERM (a preemption notice) as step 5 begins; in this process, whose loop takes the signal.
  assert threading.current_thread() is threading.main_thread(), "fit takes SIGTERM in the main thread only"
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(JittedStep, "__call__", signalling_step(JittedStep.__call__, out, at=5, wait=3,
                                                          signum=signal.SIGTERM))
    seen["preempted"] = (*_in_process(argv("--resume")), _checkpoints(out))
  seen["resumed"] = _in_process(argv("--resume"))
  return out, seen


def test_a_kill_after_a_checkpoint_is_published_loses_no_metrics_line(interrupted):
  out, seen = interrupted
  lines, checkpoints = seen["first kill"]
  assert checkpoints == [3]
  assert lines == [1, 2, 3], "checkpoint 3 was published before step 3's metrics line"
  stdout, _, _ = seen["second kill"]
  assert "resumed from checkpoint step 3" in stdout


def test_sigkill_then_resume_is_bitwise_identical(interrupted, finished_run):
  out, seen = interrupted
  _, lines, checkpoints = seen["second kill"]
  assert lines == [1, 2, 3, 4] and checkpoints == [3], "step 4 was not logged past the newest checkpoint"
  # Every line once: those past the checkpoint a run resumes from are dropped and written again.
  assert [r["step"] for r in metrics(out)] == list(range(1, SFT_STEPS + 1))
  want, got = by_step(finished_run), by_step(out)
  for step in want:  # everything but the timings
    assert without_timing(got[step]) == without_timing(want[step]), f"step {step} differs after resuming"
  jax.tree.map(np.testing.assert_array_equal, checkpoint_params(out, SFT_STEPS),
               checkpoint_params(finished_run, SFT_STEPS))


def test_sigterm_saves_and_exits_zero(interrupted):
  out, seen = interrupted
  code, preempted, checkpoints = seen["preempted"]
  assert code == 0 and preempted["resumed_from"] == 3 and preempted["preempted"] and preempted["step"] == 5 < SFT_STEPS
  assert 5 in checkpoints, "no checkpoint at the preempted step"
  code, resumed = seen["resumed"]
  assert code == 0 and resumed["resumed_from"] == 5 and not resumed["preempted"] and resumed["step"] == SFT_STEPS


def _resume_past_damage(finished_run, out, train_file, capsys):
  """Resumes `out`, a copy of the finished run cut after checkpoint 4 and that checkpoint damaged: from checkpoint 2,
  to the end."""
  assert cli.main(_argv(out, train_file, "--resume", "--no-export")) == 0
  resumed = summary(capsys.readouterr().out)
  assert resumed["resumed_from"] == 2 and resumed["step"] == SFT_STEPS
  assert (out / "checkpoints.damaged" / "4").is_dir(), "the damaged checkpoint was not kept aside"
  assert 4 in _checkpoints(out)


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(finished_run, train_file, tmp_path, capsys, caplog):
  out = cut_after(finished_run, tmp_path / "run", 4)
  for f in (out / "checkpoints" / "4" / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(b"\0" * 7)  # garbage where the arrays and metadata were
  _resume_past_damage(finished_run, out, train_file, capsys)
  assert "checkpoint step 4 is damaged" in caplog.text


def test_a_checkpoint_without_its_checksums_is_damaged_and_never_resumed_onto(finished_run, train_file, tmp_path,
                                                                             capsys, caplog):
  out = cut_after(finished_run, tmp_path / "run", 4)
  shutil.rmtree(out / "checkpoints" / "4" / "checksums")
  _resume_past_damage(finished_run, out, train_file, capsys)
  assert "checkpoint step 4 is damaged" in caplog.text and "no checksums" in caplog.text, caplog.text


def test_non_finite_gradients_skip_the_step_and_leave_parameters_untouched():
  # The model, mesh and optimizer of the runs above (the Job of their config), so the state starts from their
  # initialiser's program.
  _, overrides = cli._parser().parse_known_args(["sft", *SFT])
  cfg = config_io.apply_overrides(presets.TOY["sft"](), overrides)
  job, mesh = sft_job(cfg, ByteTokenizer()), make_mesh(cfg.mesh)
  optimizer = job.optimizer()

  def loss_fn(params, batch, rng):
    loss, metrics = sft.loss(params, batch, rng, model=job.model)
    poison = jnp.where(batch["tokens"][0, 0] == 13, jnp.nan, 1.0)  # one batch is marked
    return loss * poison, metrics

  step = make_train_step(loss_fn, optimizer, mesh=mesh,
                         state_shardings=state_shardings(job.model, optimizer, mesh, job.rules))
  state = init_state(job.model, optimizer, cfg.train.seed, mesh, job.rules)
  batch = {k: np.ones((8, 32), np.int32) * v for k, v in (("tokens", 5), ("loss_mask", 1), ("segment_ids", 1))}
  batch["positions"] = np.tile(np.arange(32, dtype=np.int32), (8, 1))
  state, metrics = step(state, batch)
  before = jax.tree.map(np.asarray, state.params)
  poisoned = dict(batch, tokens=batch["tokens"].copy())
  poisoned["tokens"][0, 0] = 13
  state, metrics = step(state, poisoned)
  assert int(metrics["skipped_steps"]) == 1 and not np.isfinite(float(metrics["grad_norm"]))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)
  state, metrics = step(state, batch)
  assert int(metrics["skipped_steps"]) == 1 and np.isfinite(float(metrics["loss"]))


def test_the_progress_bar_shows_an_rl_steps_reward_first():
  """What an RL run is watched for; a supervised step, which has none, shows its loss first."""
  shown = []

  class Bar:
    def set_postfix(self, postfix):
      shown.append(list(postfix.items()))

  class Writer:
    def write(self, record):
      pass

  for metrics in ({"loss": 0.5, "reward/mean": 0.25}, {"loss": 0.5}):
    loop._log((3, metrics, (3, 0)), loop._Meter(2, 4), lambda step: 1e-3, Writer(), Bar(), iter(()))
  assert shown[0][:2] == [("reward", "0.25"), ("loss", "0.5")] and shown[1][0] == ("loss", "0.5")
