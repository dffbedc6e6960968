"""The training job: exact resume after SIGKILL, SIGTERM, damaged checkpoints, non-finite steps."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ptx.algorithms import sft
from ptx.config import MODEL_PRESETS, Config, DataConfig, MeshConfig, OptimizerConfig, TrainConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.pipeline import make_pipeline
from ptx.data.sources import MemorySource
from ptx.data.tokenizer import ByteTokenizer
from ptx.sharding import make_mesh
from ptx.train.job import sft_job
from ptx.train import loop
from ptx.train.loop import fit
from ptx.train.optimizer import make_optimizer
from ptx.train.state import init_state, state_shardings
from ptx.train.step import make_train_step

# Long enough that a fast machine cannot finish between the test seeing step KILL_AT and its signal
# landing: 27 steps of margin (5 s here at ~5 steps/s, checkpoints included), where the test polls every 50 ms.
STEPS = 40
KILL_AT = 13  # between two checkpoints (every 4 steps), after the third
OVERRIDES = ["--model=tiny", "--model.n_layers=1", "--model.d_model=64", "--model.mlp_dim=128",
             f"--train.steps={STEPS}", "--train.log_every=1", "--train.checkpoint_every=4",
             "--data.batch_size=8", "--data.seq_len=48", "--data.num_bins=4", "--mesh.data=2", "--mesh.fsdp=4",
             "--optim.lr=3e-3"]


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "train.jsonl"
  task = ArithmeticTask(0, 3, "+*")
  path.write_text("".join(json.dumps({"prompt": task[i]["prompt"], "completion": task[i]["answer"]}) + "\n"
                          for i in range(600)))
  return path


def _command(out, train_file, *extra):
  return [sys.executable, "-m", "ptx.cli", "sft", "--out", str(out), "--no-progress",
          f"--data.train_files=[\"{train_file}\"]", *OVERRIDES, *extra]


def _env():
  # The suite's XLA flags (its -O1), then 8 devices: XLA takes a flag's last value.
  flags = f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=8"
  return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def _losses(out):
  lines = (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines()
  return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _final_params(out):
  path = pathlib.Path(out) / "checkpoints" / str(STEPS) / "state"
  return ocp.StandardCheckpointer().restore(path.absolute())["params"]


def _wait_for_step(out, step, proc, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if (pathlib.Path(out) / "metrics.jsonl").exists() and max(_losses(out), default=0) >= step:
      return
    assert proc.poll() is None, "the run ended before it was interrupted"
    time.sleep(0.05)
  raise AssertionError(f"no step {step} within {timeout}s")


def test_sigkill_then_resume_is_bitwise_identical(tmp_path, train_file):
  full = tmp_path / "full"
  subprocess.run(_command(full, train_file), env=_env(), check=True, capture_output=True)
  killed = tmp_path / "killed"
  kill_at = KILL_AT
  proc = subprocess.Popen(_command(killed, train_file), env=_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  _wait_for_step(killed, kill_at, proc)
  # Saves are async: kill only once one has been published, so there is something to resume.
  while not any(p.name.isdigit() for p in (killed / "checkpoints").glob("*")):
    assert proc.poll() is None, "the run ended before a checkpoint was published"
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  resumed = subprocess.run(_command(killed, train_file, "--resume"), env=_env(), check=True,
                           capture_output=True, text=True)
  assert "resumed from checkpoint step" in resumed.stdout, f"killed at {kill_at}: {resumed.stdout[-2000:]}"
  want, got = _losses(full), _losses(killed)
  assert sorted(got) == list(range(1, STEPS + 1)), f"killed at {kill_at}: steps {sorted(got)}"
  assert got == want, f"killed at step {kill_at}: losses differ after resuming"
  jax.tree.map(np.testing.assert_array_equal, _final_params(killed), _final_params(full))


# Run as `python -c SCRIPT OUT CHECKPOINTED CLI-ARGS...`: the CLI, its step patched to SIGKILL the process as step
# CHECKPOINTED + 1 begins, once checkpoint CHECKPOINTED is published (a GRPO step's episodes run that long).
_KILLED_AS_THE_STEP_AFTER_A_CHECKPOINT_BEGINS = """
import os, pathlib, signal, sys, time
from ptx import cli
from ptx.train.step import JittedStep
out, checkpointed = pathlib.Path(sys.argv[1]), int(sys.argv[2])
calls, run = [], JittedStep.__call__
def killed_after_the_checkpoint(self, state, batch):
  calls.append(None)
  if len(calls) == checkpointed + 1:
    while not (out / "checkpoints" / str(checkpointed)).is_dir():
      time.sleep(0.01)  # Orbax renames the step's directory into place when the save is complete
    os.kill(os.getpid(), signal.SIGKILL)
  return run(self, state, batch)
JittedStep.__call__ = killed_after_the_checkpoint
sys.exit(cli.main(sys.argv[3:]))
"""


def test_a_kill_after_a_checkpoint_is_published_loses_no_metrics_line(tmp_path, train_file):
  out = tmp_path / "run"
  argv = _command(out, train_file, "--train.steps=12")
  killed = subprocess.run([sys.executable, "-c", _KILLED_AS_THE_STEP_AFTER_A_CHECKPOINT_BEGINS, str(out), "8",
                           *argv[3:]], env=_env(), capture_output=True, text=True)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  assert "8" in os.listdir(out / "checkpoints")
  assert sorted(_losses(out)) == list(range(1, 9)), "checkpoint 8 was published before step 8's metrics line"
  resumed = subprocess.run(_command(out, train_file, "--train.steps=12", "--resume"), env=_env(), check=True,
                           capture_output=True, text=True)
  assert "resumed from checkpoint step 8" in resumed.stdout
  assert sorted(_losses(out)) == list(range(1, 13))


def test_sigterm_saves_and_exits_zero(tmp_path, train_file):
  out = tmp_path / "run"
  proc = subprocess.Popen(_command(out, train_file), env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
  _wait_for_step(out, 6, proc)
  proc.send_signal(signal.SIGTERM)
  stdout, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0
  summary = json.loads(next(l for l in stdout.splitlines() if l.startswith('{"summary"')))["summary"]
  assert summary["preempted"] and summary["step"] < STEPS
  assert str(summary["step"]) in os.listdir(out / "checkpoints"), "no checkpoint at the preempted step"


def _fit_in_process(out, steps, resume=False):
  cfg = Config(model=MODEL_PRESETS["tiny"](),
               mesh=MeshConfig(data=2, fsdp=4),
               train=TrainConfig(steps=steps, log_every=5, checkpoint_every=5, keep_checkpoints=5),
               data=DataConfig(batch_size=8, seq_len=32, num_bins=4))
  task = ArithmeticTask(0, 2)
  records = [{"prompt": task[i]["prompt"], "completion": task[i]["answer"]} for i in range(400)]
  data = make_pipeline(MemorySource(records), ByteTokenizer(), cfg.data)
  return fit(cfg, sft_job(cfg, ByteTokenizer()), train_data=data, out=out, resume=resume, progress=False)


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
  _fit_in_process(tmp_path, steps=10)
  for f in (tmp_path / "checkpoints" / "10" / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(b"\0" * 7)  # garbage where the arrays and metadata were
  state, summary = _fit_in_process(tmp_path, steps=12, resume=True)
  assert summary["resumed_from"] == 5 and int(state.step) == 12
  assert "checkpoint step 10 is damaged" in caplog.text
  assert (tmp_path / "checkpoints.damaged" / "10").is_dir(), "the damaged checkpoint was not kept aside"
  assert 10 in [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]


def test_a_checkpoint_without_its_checksums_is_damaged_and_never_resumed_onto(tmp_path, caplog):
  _fit_in_process(tmp_path, steps=10)
  shutil.rmtree(tmp_path / "checkpoints" / "10" / "checksums")
  state, summary = _fit_in_process(tmp_path, steps=12, resume=True)
  assert summary["resumed_from"] == 5 and int(state.step) == 12
  assert "checkpoint step 10 is damaged" in caplog.text and "no checksums" in caplog.text, caplog.text
  assert (tmp_path / "checkpoints.damaged" / "10").is_dir(), "the damaged checkpoint was not kept aside"


def test_non_finite_gradients_skip_the_step_and_leave_parameters_untouched(tiny_config):
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  optimizer = make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=0), 10)

  def loss_fn(params, batch, rng):
    loss, metrics = sft.loss(params, batch, rng, model=tiny_config)
    poison = jnp.where(batch["tokens"][0, 0] == 13, jnp.nan, 1.0)  # one batch is marked
    return loss * poison, metrics

  step = make_train_step(loss_fn, optimizer, mesh=mesh,
                         state_shardings=state_shardings(tiny_config, optimizer, mesh))
  state = init_state(tiny_config, optimizer, 0, mesh)
  batch = {k: np.ones((8, 16), np.int32) * v for k, v in (("tokens", 5), ("loss_mask", 1), ("segment_ids", 1))}
  batch["positions"] = np.tile(np.arange(16, dtype=np.int32), (8, 1))
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
