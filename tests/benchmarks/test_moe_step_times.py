"""benchmarks/moe.py: the MoE twin has the dense model's active parameters; the summary's ratios; --pod-fit's lines."""

import pathlib
import subprocess

from ptx.models.params import count_active_params, count_params

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "recipes"


def test_the_twin_runs_the_dense_models_active_mlp_width(import_benchmark):
  moe = import_benchmark("moe")
  models = moe.models(moe.DENSE, ["dense", "ragged"])
  assert list(models) == ["dense", "moe_dense", "moe_ragged"]
  dense, twin = models["dense"], models["moe_ragged"]
  assert twin.moe.experts_per_token * twin.moe.expert_mlp_dim == dense.mlp_dim
  router = dense.n_layers * dense.d_model * twin.moe.n_experts  # the only active parameters the dense model lacks
  assert count_active_params(twin) == count_params(dense) + router
  assert count_params(twin) > 3 * count_params(dense) // 2


def test_summary_takes_the_median_over_rounds_and_divides_by_dense(import_benchmark):
  moe = import_benchmark("moe")
  lines = [{"workload": "sft", "model": m, "step_s_median": s} for m, s in
           [("dense", 1.0), ("moe_dense", 3.0), ("dense", 2.0), ("moe_dense", 5.0), ("dense", 1.5), ("moe_dense", 4.0)]]
  [line] = moe.summary(lines)
  assert line["workload"] == "sft"
  assert line["summary"]["dense"]["step_s_median"] == 1.5 and line["summary"]["moe_dense"]["step_s_median"] == 4.0
  assert line["summary"]["moe_dense"]["over_dense"] == 4.0 / 1.5 and line["summary"]["moe_dense"]["rounds"] == [3, 5, 4]


def test_pod_fit_lines_are_pod_fit_py_records_of_the_moe_pod_presets(import_benchmark, monkeypatch):
  moe = import_benchmark("moe")
  monkeypatch.syspath_prepend(str(RECIPES))  # as benchmarks/pod_fit.py would put it, but for this test only
  presets = moe.moe_pod_presets()
  assert presets == [("grpo_moe", "qwen3_30b_a3b"), ("sft_chat", "qwen3_235b_a22b"),
                     ("sft_chat", "kimi_k2"), ("grpo_moe", "kimi_k2"),
                     ("grpo_moe", "gpt_oss_20b")]  # the dense presets left out
  assert ("sft_chat", "llama3_8b") in moe.pod_fit.PODS
  runs = []

  def run(command, **kwargs):  # benchmarks/pod_fit.py's output: progress, then its record last
    runs.append(command[1:])
    return subprocess.CompletedProcess(command, 0, stdout='compiling\n{"bench": "pod_fit", "fits": true}\n')

  monkeypatch.setattr(moe.subprocess, "run", run)
  assert moe.pod_fit_record("sft_chat", "qwen3_235b_a22b") == {"workload": "pod_fit", "bench": "pod_fit", "fits": True}
  assert runs == [[moe.pod_fit.__file__, "--recipe", "sft_chat", "--preset", "qwen3_235b_a22b"]]
