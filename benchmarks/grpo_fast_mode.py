"""GRPO on the demo's task with standard and fast rollouts: held-out pass@1, wall time and CPU seconds of each (#29).

Command (the acceptance run of `--rollout.mode`):

  .venv/bin/python benchmarks/grpo_fast_mode.py --out out/grpo_fast_mode --steps 60 --prompts 32

Stage 1 is the demo's SFT (`ptx demo --rl-steps 0`: 600 steps on 2-digit addition), reused when OUT/demo/hf
exists. Stage 2 trains GRPO from it once per mode and round, alternating standard and fast, with the same seed and
prompts, each in its own process (nothing compiled is shared; no persistent compilation cache): the toy GRPO
preset with host rewards over engine rollouts (`grpo.rollouts=engine`, the exact-answer environment scoring on the
host, as `ptx grpo --data.train_files=... --env exact_answer` trains), `--prompts` prompts of 8 samples a step,
lr 3e-4 decayed to 0 over `--steps`, `rollout.mode` standard or fast (int8 weight-only rollout weights, n-gram
speculative decoding with `--verify-cost`). Each run's final parameters are scored as the demo scores them, with the
standard sampler: greedy exact match on 512 held-out problems, pass@1 and pass@8 at temperature 1 on 256.

Timed per run: the GRPO `fit`'s wall time (compilation included), the process's CPU seconds over it, and the
median `timing_s/step` after the first two steps (compilation excluded). One JSON line per run, with the load
average before and after, then a summary line (medians over rounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

MODES = ("standard", "fast")


def _cpu_s() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def sft_params(out: pathlib.Path):
  """(the demo's SFT config, its parameters): `ptx demo --rl-steps 0` into OUT/demo, once."""
  from ptx import demo, model_config
  from ptx.models import load_hf

  cfg = demo.default_config()
  if not (out / "demo" / "hf" / "config.json").exists():
    demo.run(cfg, out / "demo", rl_steps=0, overwrite=True, progress=False)
  loaded = load_hf(out / "demo" / "hf")
  differences = model_config.architecture_differences(cfg.model, loaded.cfg)
  if differences:
    raise ValueError(f"OUT/demo/hf is another model than the demo's: {differences}")
  return cfg, loaded.params


def one_run(mode: str, out: pathlib.Path, steps: int, prompts: int, verify_cost: float, seed: int | None) -> dict:
  """Trains GRPO in `mode` from the demo's SFT parameters and scores the result."""
  import jax

  jax.config.update("jax_threefry_partitionable", True)
  from ptx import demo
  from ptx.config import RolloutConfig
  from ptx.data.tokenizer import ByteTokenizer
  from ptx.data.global_batch import to_global
  from ptx.envs.exact_answer import ExactAnswerEnv
  from ptx.sharding import make_mesh
  from ptx.train import job, streams
  from ptx.train.loop import fit
  from ptx.train.plots import read_metrics
  from ptx.episodes.scoring import EnvReward

  sft_cfg, params = sft_params(out)
  cfg = demo.grpo_config(sft_cfg, steps)
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=prompts),
                            grpo=dataclasses.replace(cfg.grpo, rollouts="engine"),
                            train=dataclasses.replace(cfg.train, log_every=1,
                                                      seed=cfg.train.seed if seed is None else seed),
                            rollout=RolloutConfig(mode=mode, verify_cost=verify_cost))
  tokenizer = ByteTokenizer()
  reward = EnvReward(ExactAnswerEnv(), tokenizer, (tokenizer.eos_id,), cfg.grpo.group_size)
  built = job.grpo_host_job(cfg, tokenizer, reward)
  data = streams.grpo_prompts(cfg, tokenizer, demo.GRPO_TASKS, in_graph=False)
  load, cpu, started = os.getloadavg()[0], _cpu_s(), time.perf_counter()
  state, summary = fit(cfg, built, train_data=data, out=out / mode, init_params=params, overwrite=True,
                       progress=False)
  wall, cpu = time.perf_counter() - started, _cpu_s() - cpu
  history = [r for r in read_metrics(out / mode / "metrics.jsonl") if "timing_s/step" in r]
  mesh = make_mesh(sft_cfg.mesh)
  scores = demo.held_out_scores(state.params, sft_cfg.model, mesh, to_global(demo.held_out_rows(sft_cfg), mesh))
  last = history[-1]
  return {"mode": mode, "seed": cfg.train.seed, "steps": summary["step"], "prompts": prompts,
          "group": cfg.grpo.group_size,
          "grpo_wall_s": round(wall, 1), "grpo_cpu_s": round(cpu, 1),
          "step_s_median": round(statistics.median(r["timing_s/step"] for r in history[2:]), 3),
          **{f"held_out/{k}": v for k, v in scores.items()},
          "reward_last": last.get("reward/mean"), "logp_gap_abs_mean": _mean(history, "rollout/logp_gap_abs"),
          "is_ratio_min": min((r["rollout/is_ratio/min"] for r in history if "rollout/is_ratio/min" in r),
                              default=None),
          "drafted_per_token": _mean(history, "rollout/drafted"),
          "draft_acceptance": _mean(history, "rollout/draft_acceptance"),
          "load_before": load, "load_after": os.getloadavg()[0]}


def _mean(history: list[dict], key: str) -> float | None:
  values = [r[key] for r in history if key in r]
  return round(statistics.mean(values), 4) if values else None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/grpo_fast_mode"))
  parser.add_argument("--steps", type=int, default=60, help="GRPO steps per run")
  parser.add_argument("--prompts", type=int, default=32, help="prompts a step (8 samples each)")
  parser.add_argument("--rounds", type=int, default=1, help="runs of each mode, alternating")
  parser.add_argument("--verify-cost", type=float, default=1.5, help="rollout.verify_cost of the fast runs")
  parser.add_argument("--seed", type=int, help="train.seed of the GRPO runs (the sampler's key; default: the demo's)")
  parser.add_argument("--only", choices=MODES, help=argparse.SUPPRESS)  # one run, in this process
  args = parser.parse_args()
  if args.only:
    print(json.dumps(one_run(args.only, args.out, args.steps, args.prompts, args.verify_cost, args.seed)), flush=True)
    return
  sft_params(args.out)  # once, before the timed runs
  runs = []
  for _ in range(args.rounds):
    for mode in MODES:
      with open(args.out / f"{mode}.log", "a") as log:  # the run's own output, beside its run directory
        done = subprocess.run([sys.executable, __file__, "--only", mode, "--out", str(args.out), "--steps",
                               str(args.steps), "--prompts", str(args.prompts), "--verify-cost",
                               str(args.verify_cost), *(["--seed", str(args.seed)] if args.seed is not None else [])],
                              check=True, stdout=subprocess.PIPE, stderr=log, text=True)
      runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
      print(json.dumps(runs[-1]), flush=True)
  summary = {mode: {key: statistics.median(r[key] for r in runs if r["mode"] == mode)
                    for key in ("held_out/pass@1", "held_out/greedy", "grpo_wall_s", "grpo_cpu_s", "step_s_median")}
             for mode in MODES}
  print(json.dumps({"summary": summary, "rounds": args.rounds}), flush=True)


if __name__ == "__main__":
  main()
