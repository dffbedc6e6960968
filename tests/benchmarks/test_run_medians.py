"""The side-by-side statistic reads the same per-run median from ptx's and the Tunix harness's JSON lines.

Each line below has the shape its side prints (benchmarks/train.py, benchmarks/sampling.py's and
benchmarks/grpo.py's records, and the harness's sections as those scripts print them), with a
mean that differs from the median, so a comparison that read the harness's mean would fail.
"""

import importlib.util
import json
import pathlib
import sys

import pytest

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "run_medians.py"
# Loaded from its file: putting benchmarks/ on sys.path would let its scripts (data.py, train.py) shadow modules.
_spec = importlib.util.spec_from_file_location("run_medians", PATH)
run_medians = sys.modules["run_medians"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(run_medians)

TOKENS = 8 * 256  # an SFT step's batch x seq_len
GEN = 16 * 64  # a sampling call's rows x new tokens


def _sft(framework, median, mean, cpu=0.9):
  return {"framework": framework, "loadavg_1m": 1.5,
          "sft": {"batch": 8, "seq_len": 256, "tokens_per_s": TOKENS / mean, "step_s": mean,
                  "step_s_median": median, "step_s_min": median * 0.9, "cpu_s_per_step": cpu}}


def _ptx_sample(median, mean):
  return {"framework": "ptx", "part": "anchor", "rows": 16, "prompts": 4, "group_size": 4, "prompt_len": 32,
          "new_tokens": 64, "gen_tokens_per_s": round(GEN / median, 1), "call_s_median": median,
          "call_s_min": median * 0.9, "runs": 5, "cpu_s_per_call": mean}


def _tunix_sample(median, mean):
  return {"framework": "tunix", "part": "anchor", "batch": 16, "prompt_len": 32, "gen_len": 64,
          "gen_tokens_per_s": round(GEN / mean, 1), "call_s": mean, "call_s_median": median,
          "call_s_min": median * 0.9, "cpu_s_per_call": mean}


def _grpo(framework, median, mean):
  return {"framework": framework, "loadavg_1m": 1.5, "step_s": mean, "step_s_median": median,
          "step_s_min": median * 0.9, "cpu_s_per_step": 1.1}


def test_sft_takes_both_sides_median_not_the_harness_mean():
  lines = [_sft("ptx", 0.25, 0.30), _sft("tunix", 0.50, 1.00)]
  out = run_medians.summary(run_medians.SFT, lines)
  assert out["ptx_tokens_per_s"] == round(TOKENS / 0.25, 1)
  assert out["tunix_tokens_per_s"] == round(TOKENS / 0.50, 1)  # the mean would give TOKENS / 1.00
  assert out["ratio"] == 2.0


def test_sampling_takes_both_sides_median_call():
  lines = [_tunix_sample(0.2, 0.4), _ptx_sample(0.1, 0.15)]
  out = run_medians.summary(run_medians.SAMPLING, lines)
  assert out["tunix_gen_tokens_per_s"] == round(GEN / 0.2, 1)
  assert out["ptx_gen_tokens_per_s"] == round(GEN / 0.1, 1)
  assert out["ratio"] == 2.0


def test_grpo_takes_both_sides_median_step():
  out = run_medians.summary(run_medians.GRPO, [_grpo("tunix", 0.5, 0.9), _grpo("ptx", 0.3, 0.35)])
  assert (out["ptx_step_s"], out["tunix_step_s"], out["ratio"]) == (0.3, 0.5, 0.6)


def test_median_over_runs_lists_every_run_in_order():
  lines = [_grpo("ptx", s, s) for s in (0.4, 0.2, 0.3)] + [_grpo("tunix", s, s) for s in (0.9, 0.5, 0.6, 0.7)]
  lines.append({"part": "summary", "ratio": 9.9})  # a closing line carries no framework: not a run
  out = run_medians.summary(run_medians.GRPO, lines)
  assert out["ptx_step_s_per_run"] == [0.4, 0.2, 0.3]
  assert out["tunix_step_s_per_run"] == [0.9, 0.5, 0.6, 0.7]
  assert (out["ptx_runs"], out["tunix_runs"]) == (3, 4)
  assert (out["ptx_step_s"], out["tunix_step_s"]) == (0.3, 0.65)
  assert out["ptx_cpu_s_per_run"] == [1.1] * 3


def test_side_by_side_folder_summaries(tmp_path, capsys):
  def write(name, lines):
    (tmp_path / name).write_text("".join(json.dumps(line) + "\n" for line in lines))

  for i, (ours, theirs) in enumerate(((0.25, 0.5), (0.2, 0.6), (0.3, 0.4)), 1):
    write(f"train_ptx_{i}.log", [_sft("ptx", ours, ours * 2)])
    write(f"train_tunix_{i}.log", [_sft("tunix", theirs, theirs * 3)])
  write("train_ptx_scan.log", [_sft("ptx", 0.4, 0.5)])
  write("sampling.log", [_tunix_sample(0.2, 0.4), _ptx_sample(0.1, 0.2), {"part": "anchor_summary"}])
  write("grpo.log", [_grpo("tunix", 0.5, 0.9), _grpo("ptx", 0.25, 0.3), {"part": "summary"}])
  run_medians.main([str(tmp_path)])
  sft, sampling, grpo = (json.loads(line) for line in capsys.readouterr().out.splitlines())
  assert sft["ptx_tokens_per_s_per_run"] == [round(TOKENS / s, 1) for s in (0.25, 0.2, 0.3)]
  assert sft["tunix_tokens_per_s"] == round(TOKENS / 0.5, 1)
  assert sft["ratio"] == 2.0
  assert sft["ptx_scan_layers_tokens_per_s"] == round(TOKENS / 0.4, 1)
  assert (sampling["ratio"], grpo["ratio"]) == (2.0, 0.5)


@pytest.mark.parametrize("count", [4, 8, 10])
def test_even_step_counts_are_refused(count):
  # The harness's per-run median is sorted(times)[n // 2]: the upper of the two middle steps when n is even.
  with pytest.raises(SystemExit, match="odd"):
    run_medians.check_odd(count, "--steps")
  run_medians.check_odd(count + 1, "--steps")
