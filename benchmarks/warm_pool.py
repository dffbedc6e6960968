"""Warm pools: terminal-task episode latency with workspaces prepared ahead against prepared at the first command.

  .venv/bin/python benchmarks/warm_pool.py [--rounds 3] [--tasks 4] [--samples 4] [--steps 3] [--threads 4]
      [--learn-s 0.5] [--workloads terminal,terminal_repo]

A step plays `--tasks` terminal tasks (`TerminalTasks(0, "train")`, new
tasks every step) x `--samples` episodes each (a GRPO group) on `--threads`
threads, as `play` runs environment steps; each episode is `ShellEnv.reset`,
the task's `reference_fix` commands, then DONE (the check), so every episode
is solved and no model runs. Before each step the trainer would update the
policy on its accelerator: `--learn-s` of sleep stands for that, time in
which this machine's CPUs are free.

Modes, alternated within each round (fresh first in even rounds, pooled first in odd ones):
- fresh: `ShellEnv()`: an episode prepares its workspace at its first command.
- pooled: `ShellEnv(pool=WarmPool(...))`; when the update before step k
  starts, the trainer (which reads its prompts a batch ahead) calls
  `env.expect` for step k's tasks, so the pool prepares them while the
  policy learns: one preparation per task, which its episodes share.

Workloads:
- terminal: the records as they are (files only): preparing is building the
  snapshot and hashing it, microseconds.
- terminal_repo: the same records with a set-up that makes the project a git
  repository with one commit (`REPO_SETUP`, deterministic: fixed dates and
  names, an index without stat data), one sandbox run of git per workspace.

One JSON line per (round, workload, mode): p50/p99 of episode latency (reset
to the check's verdict), p50/p99 of `setup_wait_s` (reset until the workspace
is open: what the first command waits for set-up), the median step wall time
(episodes only, not `--learn-s`), `cpu_s` (this process and its reaped
children: the sandboxes, git, the checks) and the load average. The closing
summary gives per workload and mode the median of per-round medians, their
range, and pooled / fresh ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time

import numpy as np

from ptx.sandbox import run as sandbox

from ptx.envs import warm_pool
from ptx.envs.shell import ShellEnv
from ptx.envs.terminal import TerminalTasks, reference_fix

REPO_SETUP = ("export GIT_AUTHOR_DATE='@0 +0000' GIT_COMMITTER_DATE='@0 +0000' GIT_AUTHOR_NAME=ptx "
              "GIT_COMMITTER_NAME=ptx GIT_AUTHOR_EMAIL=ptx@localhost GIT_COMMITTER_EMAIL=ptx@localhost && "
              "git init -q && git add -A && git commit -qm 'the project as found' && rm .git/index && "
              "git read-tree HEAD")


def _records(workload: str, step: int, tasks: int) -> list[dict]:
  records = [TerminalTasks(0, "train")[step * tasks + i] for i in range(tasks)]
  return [{**r, "setup": REPO_SETUP} for r in records] if workload == "terminal_repo" else records


def _episode(env: ShellEnv, record: dict) -> tuple[float, float, str]:
  """(latency, set-up wait, outcome) of one episode that applies the reference fix."""
  start = time.perf_counter()
  episode = env.reset(record)
  try:
    episode.lease.workspace()
    opened = time.perf_counter()
    for command in reference_fix(record):
      episode.step(command)
    outcome = episode.step("DONE").outcome
  finally:
    episode.close()
  return time.perf_counter() - start, opened - start, str(outcome)


def _cpu_s() -> float:
  t = os.times()
  return t.user + t.system + t.children_user + t.children_system


def run_mode(workload: str, pooled: bool, args: argparse.Namespace) -> dict:
  """Plays `args.steps` steps in one mode; returns its JSON line's fields."""
  group = args.tasks * args.samples
  pool = warm_pool.WarmPool(size=2 * group, concurrency=2) if pooled else None
  env = ShellEnv(pool=pool)
  latencies, waits, steps, outcomes = [], [], [], []
  cpu = _cpu_s()
  try:
    with concurrent.futures.ThreadPoolExecutor(args.threads) as threads:
      for step in range(args.steps):
        env.expect(_records(workload, step, args.tasks), args.samples)
        time.sleep(args.learn_s)  # the update before this step
        jobs = [r for r in _records(workload, step, args.tasks) for _ in range(args.samples)]
        start = time.perf_counter()
        for latency, wait, outcome in threads.map(lambda r: _episode(env, r), jobs):
          latencies.append(latency)
          waits.append(wait)
          outcomes.append(outcome)
        steps.append(time.perf_counter() - start)
    stats = dict(pool.stats) if pool else {}
  finally:
    if pool:
      pool.close()
  return {"workload": workload, "mode": "pooled" if pooled else "fresh", "episodes": len(latencies),
          "solved": outcomes.count("ok"), "p50_s": float(np.percentile(latencies, 50)),
          "p99_s": float(np.percentile(latencies, 99)), "setup_wait_p50_s": float(np.percentile(waits, 50)),
          "setup_wait_p99_s": float(np.percentile(waits, 99)), "step_s": float(np.median(steps)),
          "cpu_s": _cpu_s() - cpu, "pool": stats, "load": os.getloadavg()[0]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--tasks", type=int, default=4)
  parser.add_argument("--samples", type=int, default=4)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--threads", type=int, default=4)
  parser.add_argument("--learn-s", type=float, default=0.5)
  parser.add_argument("--workloads", default="terminal,terminal_repo")
  args = parser.parse_args()
  sandbox.backend()  # probes bwrap once per process: not a cost of either mode
  load_before = os.getloadavg()
  rows = []
  for round_ in range(args.rounds):
    for workload in args.workloads.split(","):
      for pooled in (False, True) if round_ % 2 == 0 else (True, False):
        row = {"round": round_, **run_mode(workload, pooled, args)}
        rows.append(row)
        print(json.dumps(row), flush=True)
  summary = {"summary": True, "args": vars(args), "load_before": load_before, "load_after": os.getloadavg()}
  for workload in args.workloads.split(","):
    for stat in ("p50_s", "p99_s", "setup_wait_p50_s", "step_s", "cpu_s"):
      by_mode = {m: [r[stat] for r in rows if r["workload"] == workload and r["mode"] == m]
                 for m in ("fresh", "pooled")}
      summary[f"{workload}/{stat}"] = {m: {"median": float(np.median(v)), "range": [min(v), max(v)]}
                                       for m, v in by_mode.items()}
      summary[f"{workload}/{stat}"]["pooled_over_fresh"] = (float(np.median(by_mode["pooled"]))
                                                            / float(np.median(by_mode["fresh"])))
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  main()
