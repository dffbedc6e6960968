"""Step time of a small Mixture of Experts against the dense model of equal active parameters; JSON lines.

The dense model is the Tunix harness's (benchmarks/train.py, benchmarks/grpo.py:
2 layers, d_model 256, 4 heads of 64, MLP 1024, vocab 512, float32); the
MoE replaces each MLP by 8 experts of width 512, 2 per token, so a token
runs through the same MLP width (2 x 512) and the same active parameters
but for the router (2 x 256 x 8). Each round times, in this order, the
dense model, the MoE with every `--impls` implementation, for SFT
(benchmarks/train.py's measure: 8 x 256 random tokens) and for the fused
GRPO step (benchmarks/grpo.py's ptx_round: 4 prompts x 4, 64 new tokens);
rounds repeat the order, so a load that drifts falls on every model. One
line per measurement (`step_s_median`, `cpu_s_per_step`, parameters
total and active, the load), then a summary line per workload with the
median over rounds of each model's median and its ratio to the dense
model's (the issue's goal on a device: MoE within 1.5x of dense).

On a CPU "dense" (every expert on every token, 4x the active MLP FLOPs here)
is what `moe_impl="auto"` picks; "ragged" is the accelerator's path, whose
grouped matmul XLA:CPU computes densely over every group (8x).

With `--pod-fit`, first a line per MoE pod preset (the recipes' presets of
`benchmarks/pod_fit.py` whose model has experts): its per-device memory on
its pod, as `benchmarks/pod_fit.py` measures it in a process of its own
(compiled for the pod's chips faked on CPU, a minute or two each).

  .venv/bin/python benchmarks/moe.py --rounds 3
  .venv/bin/python benchmarks/moe.py --smoke    # tiny shapes, one step: the script runs
  .venv/bin/python benchmarks/moe.py --pod-fit --rounds 0    # the pod presets' memory only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys

import jax

from ptx.model_config import ModelConfig, MoeConfig
from ptx.models.params import count_active_params, count_params

import grpo  # benchmarks/ is the script's folder, first on sys.path
import pod_fit
import train

DENSE = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=64, mlp_dim=1024,
                    rope_theta=500_000.0, norm_eps=1e-5, scan_layers=False)
EXPERTS = MoeConfig(n_experts=8, experts_per_token=2, expert_mlp_dim=512)


def models(dense: ModelConfig, impls: list[str]) -> dict[str, ModelConfig]:
  """The dense model and its MoE twin under each implementation, by name."""
  moe = dataclasses.replace(EXPERTS, expert_mlp_dim=dense.mlp_dim // EXPERTS.experts_per_token)
  out = {"dense": dense}
  out.update({f"moe_{impl}": dataclasses.replace(dense, moe=moe, moe_impl=impl) for impl in impls})
  return out


def measure(name: str, cfg: ModelConfig, workload: str, steps: int, warmup: int, smoke: bool) -> dict:
  """One timed run of `workload` ("sft" or "grpo") on `cfg`: its JSON record."""
  if workload == "sft":
    batch, seq = (2, 16) if smoke else (8, 256)
    record = train.measure(cfg, batch, seq, warmup, steps, peak_gflops=294.4)["sft"]
    figures = {"step_s_median": record["step_s_median"], "cpu_s_per_step": record["cpu_s_per_step"],
               "tokens_per_s_median": record["tokens_per_s_median"], "first_step_s": record["first_step_s"]}
  else:
    shape = dict(prompts=2, group=2, prompt_len=8, new=4) if smoke else {}
    record = grpo.ptx_round(steps, warmup, cfg=cfg, phases=False, **shape)
    figures = {k: record[k] for k in ("step_s_median", "cpu_s_per_step", "first_step_s")}
  return {"workload": workload, "model": name, **figures, "params": count_params(cfg),
          "active_params": count_active_params(cfg), "backend": jax.default_backend(),
          "loadavg_1m": os.getloadavg()[0]}


def moe_pod_presets() -> list[tuple[str, str]]:
  """The (recipe, preset) pairs of `benchmarks/pod_fit.py` whose model is a Mixture of Experts."""
  return [key for key in pod_fit.PODS if pod_fit.config(*key).model.moe.enabled]


def pod_fit_record(recipe: str, preset: str) -> dict:
  """The pod-fit JSON record of one preset, from `benchmarks/pod_fit.py` in a process faking the pod's chips."""
  out = subprocess.run([sys.executable, pod_fit.__file__, "--recipe", recipe, "--preset", preset], check=True,
                       stdout=subprocess.PIPE, text=True).stdout
  return {"workload": "pod_fit", **json.loads(out.splitlines()[-1])}


def summary(lines: list[dict]) -> list[dict]:
  """Per workload: every model's median over rounds of its per-round medians, and the ratio to dense."""
  out = []
  for workload in dict.fromkeys(line["workload"] for line in lines):
    medians = {}
    for line in lines:
      if line["workload"] == workload:
        medians.setdefault(line["model"], []).append(line["step_s_median"])
    dense = statistics.median(medians["dense"])
    out.append({"workload": workload, "summary": {
        name: {"step_s_median": statistics.median(v), "over_dense": statistics.median(v) / dense, "rounds": v}
        for name, v in medians.items()}})
  return out


def main() -> None:
  """Prints the MoE pod presets' lines (--pod-fit), then a JSON line per measurement and a summary per workload."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=1)
  p.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--impls", default="dense,ragged", help="MoE implementations to time (model.moe_impl)")
  p.add_argument("--workloads", default="sft,grpo")
  p.add_argument("--smoke", action="store_true", help="tiny shapes, one step after one warm-up")
  p.add_argument("--pod-fit", action="store_true", help="first, the per-device memory of the MoE pod presets")
  args = p.parse_args()
  if args.pod_fit:
    for recipe, preset in moe_pod_presets():
      print(json.dumps(pod_fit_record(recipe, preset)), flush=True)
  steps, warmup = (1, 1) if args.smoke else (args.steps, args.warmup)
  smoke_model = dataclasses.replace(DENSE, d_model=32, n_heads=2, n_kv_heads=2, head_dim=16, mlp_dim=64)
  dense = smoke_model if args.smoke else DENSE
  lines = []
  for _ in range(args.rounds):
    for workload in args.workloads.split(","):
      for name, cfg in models(dense, args.impls.split(",")).items():
        lines.append(measure(name, cfg, workload, steps, warmup, args.smoke))
        print(json.dumps(lines[-1]), flush=True)
  for line in summary(lines):
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
  main()
