"""Sandbox throughput: runs per second of the bwrap backend against the weaker rlimits one.

For each backend, each program and each concurrency it starts `--runs`
sandboxed runs from that many threads and prints one JSON line: runs/s of
wall time, the CPU seconds the host spent per run (the sandbox's own
processes and the program's, from RUSAGE_CHILDREN), and the outcomes. The
programs: `true` (the cost of the sandbox itself), `python3 -c pass` (what
a code task pays before its first line), and a program that burns one CPU
second (concurrency past the core count queues them). Then one line per
concurrency for scoring a correct solution with `PythonTestsEnv` (a code
task's whole reward: the solution's sandbox plus a fork of the grading
server; the forks' CPU, about 2 ms each, is spent in the server and not
counted). The two backends
alternate, program by program, so load drift hits both alike. State the
machine's load beside the figures (`uptime`): on 2 shared cores runs/s
moves with it.

    .venv/bin/python benchmarks/sandbox.py               # concurrency 1, 2, 16
    .venv/bin/python benchmarks/sandbox.py --runs 16 --concurrency 1 16
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import resource
import time

from ptx.sandbox import run as sandbox
from ptx.envs.python_tests import PythonTestsEnv

PROGRAMS = {
    "true": ["true"],
    "python_pass": ["python3", "-c", "pass"],
    "cpu_1s": ["python3", "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"],
}
LIMITS = sandbox.Limits(timeout_s=120.0, cpu_s=30, memory_bytes=512 << 20)
TASK = {"prompt": "Write add(a, b).",
        "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}
ANSWER = "```python\ndef add(a, b):\n    return a + b\n```"


def measure(backend: str, program: str, concurrency: int, runs: int) -> dict:
  """Runs `program` `runs` times from `concurrency` threads under `backend`; the figures as a dict."""
  sandbox.use(backend)
  argv = PROGRAMS[program]
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    results = list(pool.map(lambda _: sandbox.run(argv, limits=LIMITS), range(runs)))
  wall = time.perf_counter() - start
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  return {"backend": backend, "program": program, "concurrency": concurrency, "runs": runs,
          "runs_per_s": round(runs / wall, 2), "wall_s": round(wall, 3), "host_cpu_s_per_run": round(cpu / runs, 4),
          "outcomes": dict(collections.Counter(str(r.outcome) for r in results)),
          "load_1min": round(os.getloadavg()[0], 2)}


def measure_scoring(backend: str, concurrency: int, runs: int) -> dict:
  """Scores a correct solution `runs` times from `concurrency` threads under `backend`; the figures as a dict."""
  sandbox.use(backend)
  env = PythonTestsEnv()
  env.reset(TASK).step(ANSWER)  # starts the grading server: a cost paid once per process
  before = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time()
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    steps = list(pool.map(lambda _: env.reset(TASK).step(ANSWER), range(runs)))
  wall = time.perf_counter() - start
  after = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time()
  cpu = (after[0].ru_utime - before[0].ru_utime) + (after[0].ru_stime - before[0].ru_stime) + after[1] - before[1]
  return {"backend": backend, "program": "python_tests_score", "concurrency": concurrency, "runs": runs,
          "runs_per_s": round(runs / wall, 2), "wall_s": round(wall, 3), "host_cpu_s_per_run": round(cpu / runs, 4),
          "outcomes": dict(collections.Counter(str(s.outcome) for s in steps)),
          "load_1min": round(os.getloadavg()[0], 2)}


def main() -> None:
  """Prints one JSON line per backend x program x concurrency."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 16])
  parser.add_argument("--runs", type=int, default=32, help="runs per measurement (the 1 s program: a quarter)")
  parser.add_argument("--backends", nargs="+", default=["bwrap", "rlimits"], choices=[b.value for b in sandbox.Backend])
  args = parser.parse_args()
  for program in PROGRAMS:
    runs = max(args.runs // 4, 2) if program == "cpu_1s" else args.runs
    for concurrency in args.concurrency:
      for backend in args.backends:
        print(json.dumps(measure(backend, program, concurrency, max(runs, concurrency))), flush=True)
  for concurrency in args.concurrency:
    for backend in args.backends:
      print(json.dumps(measure_scoring(backend, concurrency, max(args.runs, concurrency))), flush=True)


if __name__ == "__main__":
  main()
