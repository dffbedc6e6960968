"""benchmarks/moe.py: the MoE twin has the dense model's active parameters; the summary's medians and ratios."""

from ptx.models.params import count_active_params, count_params


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
