"""SFT training throughput on the Tunix harness's config (benchmarks/tunix_harness.py); prints one JSON line.

Same work as the Tunix anchor: a 2-layer decoder (d_model 256, 4 heads of 64,
MLP 1024, vocab 512, float32, untied), AdamW, batch 8 x 256 random tokens with
every target counted, one device. Each step is timed blocked, after warm-up;
`step_s_median` is the run's figure in a side-by-side comparison
(benchmarks/run_medians.py), with `cpu_s_per_step`, the process CPU seconds.
The two layers run unrolled, as Tunix runs its layers (a Python loop);
`--scan-layers` times ptx's scanned layers instead (`ModelConfig.scan_layers`).

  .venv/bin/python benchmarks/train.py --steps 10
  /tmp/tunix-venv/bin/python $TUNIX_BENCH --parts sft   # the peer, same machine

MFU divides achieved model FLOP/s (6 x parameters x tokens for the matmuls,
plus 12 x layers x T x d_model per token for attention scores) by a peak you
pass with --peak-gflops (default: this 2-core AVX-512 CPU at 2.3 GHz, 2 FMA
units x 16 float32 lanes x 2 flops x 2 cores = 294 GFLOP/s).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import time

import jax
import numpy as np

from ptx.algorithms import sft
from ptx.config import MeshConfig, OptimizerConfig
from ptx.model_config import ModelConfig
from ptx.models import count_params
from ptx.models.params import count_active_params
from ptx.sharding import make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.state import init_state, state_shardings
from ptx.train.step import make_train_step


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Model FLOPs of one training token (forward + backward): 6 x active parameters + attention scores' 12 L T d.

  A Mixture of Experts counts the experts a token is routed to (`count_active_params`), not all of them.
  """
  return 6 * count_active_params(cfg) + 12 * cfg.n_layers * seq_len * cfg.d_model


def measure(cfg: ModelConfig, batch_size: int, seq_len: int, warmup: int, steps: int, peak_gflops: float) -> dict:
  """Times `warmup + steps` SFT steps of `cfg` on one device, each blocked; returns the JSON record.

  Args:
    cfg: the model, with its dtypes and attention implementation.
    batch_size: rows per step.
    seq_len: tokens per row, random ids in [3, V), every one a target.
    warmup: untimed steps first (the first compiles).
    steps: timed steps.
    peak_gflops: the device's peak, the denominator of `mfu`.

  Returns:
    The record main prints: figures of the timed steps under "sft" (medians, means, MFU, losses).
  """
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=1), jax.devices()[:1])
  optimizer = make_optimizer(OptimizerConfig(lr=1e-5, warmup_steps=0, weight_decay=0.0, clip_norm=0.0),
                             warmup + steps)
  state = init_state(cfg, optimizer, 0, mesh)
  step = make_train_step(functools.partial(sft.loss, model=cfg), optimizer, mesh=mesh,
                         state_shardings=state_shardings(cfg, optimizer, mesh))
  rng = np.random.default_rng(0)
  shape = (batch_size, seq_len)
  batch = {"tokens": rng.integers(3, cfg.vocab_size, shape).astype(np.int32), "loss_mask": np.ones(shape, np.int32),
           "segment_ids": np.ones(shape, np.int32),
           "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape).copy()}
  batch = jax.device_put(batch)

  times, cpu, losses = [], [], []
  for i in range(warmup + steps):
    start, cpu_start = time.perf_counter(), time.process_time()
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))  # blocks, as the anchor's timing does
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - cpu_start)
  timed = times[warmup:]
  tokens = batch_size * seq_len
  mean = statistics.mean(timed)
  return {
      "framework": "ptx", "jax_version": jax.__version__, "backend": jax.default_backend(), "devices": 1,
      "cpu_count": os.cpu_count(), "loadavg_1m": os.getloadavg()[0], "n_params": count_params(cfg),
      "sft": {
          "batch": batch_size, "seq_len": seq_len, "scan_layers": cfg.scan_layers, "tokens_per_s": tokens / mean,
          "tokens_per_s_median": tokens / statistics.median(timed), "tokens_per_s_best": tokens / min(timed),
          "step_s": mean, "step_s_min": min(timed), "step_s_median": statistics.median(timed),
          "cpu_s_per_step": statistics.mean(cpu[warmup:]), "first_step_s": times[0],
          "mfu": flops_per_token(cfg, seq_len) * tokens / statistics.median(timed) / (peak_gflops * 1e9),
          "loss_first": losses[0], "loss_last": losses[-1],
      },
      "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
  }


def main() -> None:
  """Times the SFT steps and prints one JSON line."""
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=256)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--peak-gflops", type=float, default=294.4)
  parser.add_argument("--scan-layers", action="store_true",
                      help="run the layers under lax.scan (the default for deep models) instead of unrolled")
  args = parser.parse_args()

  cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=64, mlp_dim=1024,
                    rope_theta=500_000.0, norm_eps=1e-5, scan_layers=args.scan_layers)
  print(json.dumps(measure(cfg, args.batch, args.seq_len, args.warmup, args.steps, args.peak_gflops)))


if __name__ == "__main__":
  main()
