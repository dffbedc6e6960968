"""benchmarks/agent.py runs its methods on the same episodes and prints its figures."""

import argparse
import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "agent.py"


def test_both_methods_play_the_same_episodes_and_print_a_summary():
  out = subprocess.run([sys.executable, str(SCRIPT), "--model", "toy", "--episodes", "8", "--concurrent", "4",
                        "--samples", "2", "--rounds", "1", "--tool-min", "0.001", "--tool-max", "0.005",
                        "--turn-tokens", "4", "--context", "256", "--max-warmups", "0", "--warmup-episodes", "4",
                        "--methods", "overlap,lockstep,play_lockstep"],
                       capture_output=True, text=True, check=True)
  lines = [json.loads(line) for line in out.stdout.splitlines()]
  runs = {line["method"]: line for line in lines if "method" in line}
  assert set(runs) == {"overlap", "lockstep", "play_lockstep"}
  for run in runs.values():
    assert run["episodes_done"] == 8 and run["tool_calls"] == 8 * 3  # every episode took its three tool calls
    assert 0 < run["device_busy_frac"] <= 1 and run["episodes_per_s"] > 0 and run["cpu_s"] > 0
    assert run["warmup_runs"] >= 2  # on the first 4 episodes, then the timed run of all 8
  summary = lines[-1]["summary"]
  assert summary["overlap_over_lockstep"] > 0 and summary["overlap_over_play_lockstep"] > 0
  assert len(summary["overlap"]["runs"]) == 1
  # Decoding costs time, so neither method can beat its tool floor.
  for method, run in runs.items():
    assert run["wall_s"] >= summary["tool_floor_s"][method] > 0
  assert summary["tool_bound"] >= 1  # lockstep waits for every tool the episode loop waits for, at least
  assert summary["tool_bound_ideal"] >= summary["tool_bound"]  # the loop's tail can only lower it


@pytest.fixture(scope="module")
def agent(import_benchmark):
  return import_benchmark("agent")


def test_the_ideal_tool_bound_is_the_expected_maximum_over_the_mean_for_many_uniform_draws(agent):
  args = argparse.Namespace(concurrent=64, samples=4, turns=3, tool_min=0.1, tool_max=1.0, tool_dist="uniform")
  tasks = [{"prompt": f"task {i}"} for i in range(64)]
  # 4 waves of 64 draws per turn: E[max of 64 draws of U(0.1, 1)] / E[draw] = (0.1 + 0.9 * 64 / 65) / 0.55 = 1.79;
  # the draws are seeded, so this is one sample of it, within a few percent.
  assert 1.7 < agent.tool_floors(tasks, args)["tool_bound_ideal"] < 1.85
  # Log-uniform on [0.1, 1]: the mean is 0.9 / ln 10 = 0.39 and the max of 64 draws about 0.96: 2.46.
  args.tool_dist = "loguniform"
  floors = agent.tool_floors(tasks, args)
  assert 2.3 < floors["tool_bound_ideal"] < 2.6
  # With 4 episodes per slot the last ones admitted run on alone: the loop's own floor is well above the spread's.
  assert floors["tool_floor_s"]["overlap"] > 1.2 * floors["tool_floor_s"]["overlap_ideal"]


def test_episodes_start_in_order_as_their_groups_slots_come_free(agent):
  admitted_in_order = agent.admitted_in_order
  assert admitted_in_order([1, 1, 1, 1], slots=2, group=1) == 2
  # One at a time, the short ones fill the second slot while the long one runs: 3.
  assert admitted_in_order([3, 1, 1, 1], slots=2, group=1) == 3
  # In pairs, the second pair waits for both slots: it starts at 3.
  assert admitted_in_order([3, 1, 1, 1], slots=2, group=2) == 4
  assert admitted_in_order([3, 1, 1, 1], slots=4, group=2) == 3
