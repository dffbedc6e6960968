"""benchmarks/agent.py runs both methods on the same episodes and prints its figures."""

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "agent.py"


def test_both_methods_play_the_same_episodes_and_print_a_summary():
  out = subprocess.run([sys.executable, str(SCRIPT), "--model", "toy", "--episodes", "8", "--concurrent", "4", "--samples", "2",
                        "--rounds", "1", "--tool-min", "0.001", "--tool-max", "0.005", "--turn-tokens", "4",
                        "--context", "256", "--max-warmups", "0"], capture_output=True, text=True, check=True)
  lines = [json.loads(line) for line in out.stdout.splitlines()]
  runs = {line["method"]: line for line in lines if "method" in line}
  assert set(runs) == {"overlap", "lockstep"}
  for run in runs.values():
    assert run["episodes_done"] == 8 and run["tool_calls"] == 8 * 3  # every episode took its three tool calls
    assert 0 < run["device_busy_frac"] <= 1 and run["episodes_per_s"] > 0 and run["cpu_s"] > 0
  summary = lines[-1]["summary"]
  assert summary["overlap_over_lockstep"] > 0 and len(summary["overlap"]["runs"]) == 1
