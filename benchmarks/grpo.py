"""GRPO step time on the Tunix harness's `--parts grpo` config (benchmarks/tunix_harness.py), with the phase split.

Same work as the Tunix anchor: a 2-layer decoder (d_model 256, 4 heads of 64,
MLP 1024, vocab 512, float32, untied, RoPE theta 5e5), one device; 4 prompts
x group 4, each BOS + 31 random ids in [3, V) (no padding), 64 new tokens at
temperature 1 with stop id V (never emitted, so every row generates all 64),
reward = fraction of even ids, beta 0.04 (KL k3 in the loss against a frozen
reference copy), mu = 1 with one AdamW update (lr 1e-5, optax.adamw's
defaults b2 0.999 and weight decay 1e-4, no clipping) per step. The two layers
run unrolled (`scan_layers=False`), as Tunix runs its layers.

`step` is ptx's fused step (sample -> reward -> advantages -> update, one
executable), blocked per step. The phase split times the same pieces as
separate programs, each blocked: `sample` (update.sample), `reward`,
`logps` (the reference log-probs of the 16 x 96 tokens; on-policy the old
log-probs are the sampler's, so there is no other log-prob pass) and
`update` (update.learn minus `logps`, which it also computes). One JSON line
per round; with --tunix-python, rounds alternate with the anchor run by that
interpreter (an odd --steps), and a closing line gives every round's median
step, the median of the per-round medians on each side and their ratio
(benchmarks/run_medians.py).

    .venv/bin/python benchmarks/grpo.py --rounds 3 --tunix-python /tmp/tunix-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import jax
import numpy as np

from ptx.config import GRPOConfig, MeshConfig, OptimizerConfig
from ptx.model_config import ModelConfig
from ptx.sharding import make_mesh
from ptx.train.grpo import fused, update
from ptx.train.optimizer import make_optimizer
from ptx.train.state import init_state, state_shardings
from ptx.train.step import model_params, reference_params

import run_medians  # benchmarks/ is the script's folder, first on sys.path
import tunix_harness

CFG = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=64, mlp_dim=1024,
                  rope_theta=500_000.0, norm_eps=1e-5, scan_layers=False)
PROMPTS, GROUP, PROMPT_LEN, NEW, BETA = 4, 4, 32, 64, 0.04


def _even_ids(gen, task):
  """The anchor's reward: the fraction of even token ids in the completion."""
  del task
  return (gen.tokens % 2 == 0).mean(axis=1)


def _blocked(fn, *args):
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - start


def ptx_round(steps: int, warmup: int, cfg: ModelConfig = CFG, prompts: int = PROMPTS, group: int = GROUP,
              prompt_len: int = PROMPT_LEN, new: int = NEW, phases: bool = True) -> dict:
  """Times `steps` fused GRPO steps after `warmup`, and (with `phases`) the phases as separate programs.

  Args:
    steps: timed steps.
    warmup: untimed steps first (the first compiles).
    cfg: the model (the anchor's by default).
    prompts: prompts per step, each BOS + `prompt_len - 1` random ids.
    group: completions per prompt.
    prompt_len: tokens per prompt.
    new: tokens generated per completion (all of them: the stop id is never emitted).
    phases: also time sample / reward / logps / update as separate programs (four more compiles).

  Returns:
    The round's JSON record.
  """
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=1), jax.devices()[:1])
  optimizer = make_optimizer(OptimizerConfig(lr=1e-5, warmup_steps=0, min_lr_ratio=1.0, b2=0.999,
                                             weight_decay=1e-4, clip_norm=0.0), warmup + steps)
  grpo_cfg = GRPOConfig(group_size=group, beta=BETA, max_response_tokens=new)
  shardings = state_shardings(cfg, optimizer, mesh, with_reference=True)
  state = init_state(cfg, optimizer, 0, mesh, with_reference=True)
  spec = update.RLSpec(model=cfg, grpo=grpo_cfg, max_new_tokens=new, stop_ids=(cfg.vocab_size,))
  step = fused.make_grpo_step(spec, _even_ids, optimizer=optimizer, mesh=mesh, state_shardings=shardings)
  rng = np.random.default_rng(0)

  def batch():
    ids = np.concatenate([np.ones((prompts, 1), np.int32),
                          rng.integers(3, cfg.vocab_size, (prompts, prompt_len - 1)).astype(np.int32)], axis=1)
    return {"prompts": ids, "prompt_lengths": np.full(prompts, prompt_len, np.int32), "task": {}}

  times, cpu = [], []
  for i in range(warmup + steps):
    b, c0 = batch(), time.process_time()
    (state, metrics), t = _blocked(step, state, b)
    times.append(t)
    cpu.append(time.process_time() - c0)
  timed = times[warmup:]
  record = {"framework": "ptx", "num_prompts": prompts, "group_size": group, "prompt_len": prompt_len,
            "gen_len": new, "beta": BETA, "step_s_median": round(statistics.median(timed), 4),
            "step_s_min": round(min(timed), 4), "step_s": round(statistics.mean(timed), 4),
            "cpu_s_per_step": round(statistics.mean(cpu[warmup:]), 4), "first_step_s": round(times[0], 3),
            "step_times_s": [round(t, 4) for t in times],
            "response_length_mean": float(metrics["response_length/mean"]),
            # jit's count of compiled programs (a private method, absent in some JAX versions).
            "executables_per_step": getattr(step, "_cache_size", lambda: None)(), "loadavg_1m": os.getloadavg()[0]}
  if phases:
    record["phase_s"] = _phases(state, batch, spec, optimizer, mesh, group, steps, warmup)
  return record


def _phases(state, batch, spec, optimizer, mesh, group: int, steps: int, warmup: int) -> dict[str, float]:
  """Median seconds of sample, reward, logps and update, each a separate blocked program."""
  under_mesh = lambda f: lambda *a: _with_mesh(mesh, f, *a)
  sample = jax.jit(under_mesh(lambda s, p, l, k: update.sample(model_params(s, None), p, l, k, spec)))
  rollout = jax.jit(under_mesh(lambda p, l, g: update.rollout_batch(p, l, g, group)))
  reward = jax.jit(lambda g: _even_ids(g, None))
  logps = jax.jit(under_mesh(lambda s, b: update.batch_logps(reference_params(s), b, spec)))
  learn = jax.jit(under_mesh(lambda s, b, g, r: update.learn(s, b, g, r, jax.random.key(1), spec, optimizer)),
                  donate_argnums=0)
  phases = {k: [] for k in ("sample", "reward", "logps", "learn")}
  for i in range(warmup + steps):
    b = batch()
    gen, t = _blocked(sample, state, b["prompts"], b["prompt_lengths"], jax.random.key(i))
    phases["sample"].append(t)
    rewards, t = _blocked(reward, gen)
    phases["reward"].append(t)
    rollouts = jax.block_until_ready(rollout(b["prompts"], b["prompt_lengths"], gen))
    _, t = _blocked(logps, state, rollouts)
    phases["logps"].append(t)
    (state, _), t = _blocked(learn, state, rollouts, gen, rewards)
    phases["learn"].append(t)
  med = {k: statistics.median(v[warmup:]) for k, v in phases.items()}
  return {"sample": round(med["sample"], 5), "reward": round(med["reward"], 5), "logps": round(med["logps"], 5),
          "update": round(med["learn"] - med["logps"], 5)}


def _with_mesh(mesh, fn, *args):
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return fn(*args)


def main() -> None:
  """Runs the rounds and prints one JSON line each, then the side-by-side summary."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=5, help="timed steps per round")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--rounds", type=int, default=1, help="rounds (alternating with Tunix when --tunix-python)")
  p.add_argument("--tunix-python", default="", help="interpreter of a venv with google-tunix installed")
  args = p.parse_args()
  if args.tunix_python:
    run_medians.check_odd(args.steps, "--steps")
  lines = []
  for _ in range(args.rounds):
    if args.tunix_python:
      bench = tunix_harness.path()
      line = subprocess.run([args.tunix_python, str(bench), "--parts", "grpo", "--steps", str(args.steps),
                             "--warmup", str(args.warmup), "--beta", str(BETA)], capture_output=True, text=True,
                            check=True).stdout.strip().splitlines()[-1]
      record = json.loads(line)
      lines.append({"framework": "tunix", "loadavg_1m": record["loadavg_1m_end"], **record["grpo"]})
      print(json.dumps(lines[-1]), flush=True)
    lines.append(ptx_round(args.steps, args.warmup))
    print(json.dumps(lines[-1]), flush=True)
  if args.tunix_python:
    print(json.dumps({**run_medians.summary(run_medians.GRPO, lines), "loadavg_1m": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
  main()
