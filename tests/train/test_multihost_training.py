"""2 processes x 4 devices (gloo) train exactly like 1 process x 8 devices."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

from ptx import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 6


def _sft(out, train_file, *extra):
  """`ptx sft`'s arguments for the run both set-ups train."""
  return ["sft", "--out", str(out), "--no-progress", f"--data.train_files=[\"{train_file}\"]", "--model=tiny",
          "--model.n_layers=1", f"--train.steps={STEPS}", "--train.log_every=1", "--train.checkpoint_every=3",
          "--data.batch_size=8", "--data.seq_len=32", "--data.pack=false", "--mesh.data=2", "--mesh.fsdp=4", *extra]


def _env(devices):
  """A subprocess's environment: the suite's XLA flags (its -O0), then `devices` (XLA takes a flag's last value)."""
  flags = f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={devices}"
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


def _losses(out):
  return [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_match_one_process(tmp_path):
  train_file = tmp_path / "train.jsonl"
  train_file.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "completion": str(2 * i)}) + "\n"
                                for i in range(300)))
  # 1 process x 8 devices: this one (the suite's XLA flags and 8 CPU devices), saving a process's start.
  assert cli.main(_sft(tmp_path / "one", train_file)) == 0
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen([sys.executable, "-m", "ptx.cli",
                             *_sft(tmp_path / "two", train_file, f"--coordinator=localhost:{port}",
                                   "--num-processes=2", f"--process-id={i}")],
                            env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(2)]
  # A hang guard only (a process that never reaches the coordinator), far above the run's own time.
  logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
  one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
  assert len(one) == len(two) == STEPS
  # The same SPMD program; gloo's all-reduces across processes may add the 8 shards in another order than one
  # process's: float32 rounding of losses near 5 (ulp 4.8e-7), a few ulps.
  np.testing.assert_allclose(two, one, rtol=1e-6, atol=1e-6)
  assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["3", "6"]
