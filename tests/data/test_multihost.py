"""Two real JAX processes (gloo on CPU) assemble one global batch from their shards."""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

from ptx.config import DataConfig
from ptx.data import ByteTokenizer, MemorySource, make_pipeline

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORDS = [{"prompt": f"#{i} q", "completion": "a" * (i % 7 + 1)} for i in range(40)]
CONFIG = DataConfig(batch_size=4, seq_len=32, num_bins=4, num_epochs=1)


def test_global_batch_is_the_hosts_batches_stacked_in_process_order(tmp_path):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = str(s.getsockname()[1])
  out = tmp_path / "global.npz"
  # Each process sees 4 of the 8 global devices, as on two 4-chip hosts.
  # The suite's XLA flags (its -O0), then 4 devices: XLA takes a flag's last value.
  flags = f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=4"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "PYTHONPATH": str(ROOT)}
  procs = [subprocess.Popen([sys.executable, "-m", "tests.data.multihost_worker", str(i), port, str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(2)]
  # A hang guard only (a process that never reaches the coordinator): both finish in seconds, loaded or not.
  logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
  gathered = np.load(out)
  hosts = [next(iter(make_pipeline(MemorySource(RECORDS), ByteTokenizer(), CONFIG, process_index=p,
                                   process_count=2))) for p in range(2)]
  for key in ("tokens", "loss_mask", "segment_ids", "positions"):
    np.testing.assert_array_equal(gathered[key], np.concatenate([h[key] for h in hosts]))
