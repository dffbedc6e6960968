"""benchmarks/scheduler.py times the local executor's jobs and prints a line per cell and a summary."""

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler.py"


def test_each_cell_runs_its_jobs_and_reports_throughput_and_latency():
  out = subprocess.run([sys.executable, str(SCRIPT), "--executors", "local", "--durations", "0.001,0.002",
                        "--concurrencies", "2,16", "--quick"], capture_output=True, text=True, check=True)
  lines = [json.loads(line) for line in out.stdout.splitlines()]
  cells, summary = lines[:-1], lines[-1]
  assert [(c["job_s"], c["concurrency"], c["jobs"]) for c in cells] == [(0.001, 2, 100), (0.001, 16, 100),
                                                                       (0.002, 2, 100), (0.002, 16, 100)]
  for c in cells:
    # A job sleeps its duration: no attempt returns sooner.
    assert c["latency_ms_p99"] >= c["latency_ms_p50"] >= c["job_s"] * 1e3 and c["jobs_per_s"] > 0
  assert summary["summary"] == "scheduler executors" and "ray_overhead_ms_per_job" not in summary
