"""The scheduler's executors: throughput and latency of 1 ms, 100 ms and 1 s jobs, local against Ray.

  .venv/bin/python benchmarks/scheduler.py [--quick] [--ray-slots 16] [--executors local,ray]

Each job sleeps its duration (`asyncio.sleep`, on a Ray worker in that
worker's own loop) and returns. For each executor, duration and concurrency
(2, 16, 256), a `ptx.scheduling.scheduler.Scheduler` of that concurrency runs the jobs
and one JSON line gives `jobs_per_s` (jobs over the cell's wall time) and the
p50/p99 of each attempt's latency: from the moment the scheduler starts the
attempt (for Ray: hands it to Ray) to its result, so queueing in the
scheduler is left out and queueing inside Ray is not. The Ray executor runs on
a local Ray instance of `--ray-slots` CPU slots (each job holds one): a slot
is a worker process, so concurrency beyond the slots waits in Ray's queue
(`ray_slots` says so in each line). `cpu_s` is this process's CPU time (Ray's
workers and raylet not included).

The closing summary line states Ray's overhead per job: the median latency of
1 ms jobs at concurrency 2 on Ray minus the same on the local executor, and the
load average (`os.getloadavg`) before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import time

import numpy as np

from ptx.scheduling import scheduler as sched
from ptx.scheduling.executors import LocalExecutor

DURATIONS_S = (0.001, 0.1, 1.0)
CONCURRENCIES = (2, 16, 256)


class _Timed:
  """An executor that records each attempt's latency (start to result) around another one."""

  def __init__(self, inner):
    self.inner = inner
    self.latencies_s: list[float] = []

  def bind(self, job):
    attempt = self.inner.bind(job)

    async def timed():
      start = time.perf_counter()
      try:
        return await attempt()
      finally:
        self.latencies_s.append(time.perf_counter() - start)
    return timed


def _jobs(duration_s: float, concurrency: int, quick: bool) -> int:
  """Jobs per cell: waves of the concurrency (8 of jobs under 0.1 s, 4 under 1 s, else 2), at least 200, 10 or 4
  (enough short jobs for a p99), half with --quick."""
  waves, least = (8, 200) if duration_s < 0.1 else (4, 10) if duration_s < 1 else (2, 4)
  return max(concurrency * waves, least) // (2 if quick else 1)


def _cell(executor, name: str, duration_s: float, concurrency: int, n: int, ray_slots: int | None) -> dict:
  timed = _Timed(executor)

  async def main():
    async with sched.Scheduler(concurrency, executor=timed) as s:
      results = await s.run(sched.Work(functools.partial(asyncio.sleep, duration_s), key=i) for i in range(n))
    return s, results

  cpu, start = time.process_time(), time.perf_counter()
  s, results = asyncio.run(main())
  wall, cpu = time.perf_counter() - start, time.process_time() - cpu
  if dict(s.counts) != {"ok": n}:
    raise RuntimeError(f"{name} {duration_s} s x {concurrency}: outcomes {dict(s.counts)}, want {n} ok")
  lat_ms = np.asarray(timed.latencies_s) * 1e3
  return {"executor": name, "job_s": duration_s, "concurrency": concurrency, "jobs": n,
          "jobs_per_s": round(n / wall, 2), "latency_ms_p50": round(float(np.percentile(lat_ms, 50)), 2),
          "latency_ms_p99": round(float(np.percentile(lat_ms, 99)), 2), "wall_s": round(wall, 3),
          "cpu_s": round(cpu, 3), "ray_slots": ray_slots, "load": os.getloadavg()[0]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="half the jobs per cell")
  parser.add_argument("--ray-slots", type=int, default=16, help="CPU slots (worker processes) of the local Ray")
  parser.add_argument("--executors", default="local,ray", help="comma-separated: local, ray")
  parser.add_argument("--durations", default=",".join(map(str, DURATIONS_S)), help="job seconds, comma-separated")
  parser.add_argument("--concurrencies", default=",".join(map(str, CONCURRENCIES)), help="comma-separated")
  args = parser.parse_args()
  durations = [float(d) for d in args.durations.split(",")]
  concurrencies = [int(c) for c in args.concurrencies.split(",")]
  load_before = os.getloadavg()
  executors = {}
  for name in args.executors.split(","):
    if name == "local":
      executors[name] = (LocalExecutor(), None)
    elif name == "ray":
      import ray

      from ptx.scheduling.ray_executor import RayExecutor

      ray.init(address="local", num_cpus=args.ray_slots, include_dashboard=False, log_to_driver=False)
      executors[name] = (RayExecutor(), args.ray_slots)
      # Starts the workers (one per slot) before timing: their start-up is a cost once per cluster, not per job.
      _cell(RayExecutor(), "ray", 0.5, args.ray_slots, args.ray_slots, args.ray_slots)
    else:
      raise SystemExit(f"--executors: unknown executor {name!r} (local, ray)")
  p50 = {}
  for duration_s in durations:
    for concurrency in concurrencies:
      for name, (executor, slots) in executors.items():
        line = _cell(executor, name, duration_s, concurrency, _jobs(duration_s, concurrency, args.quick), slots)
        p50[name, duration_s, concurrency] = line["latency_ms_p50"]
        print(json.dumps(line), flush=True)
  summary = {"summary": "scheduler executors", "quick": args.quick, "load_before": load_before,
             "load_after": os.getloadavg(), "cpus": os.cpu_count()}
  if {"local", "ray"} <= set(executors):  # at the shortest jobs and the lowest concurrency: the least queueing
    at = (durations[0], concurrencies[0])
    summary["ray_overhead_ms_per_job"] = {"job_s": at[0], "concurrency": at[1],
                                          "p50": round(p50[("ray", *at)] - p50[("local", *at)], 2)}
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  main()
