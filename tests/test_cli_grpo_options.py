"""`ptx grpo --grpo.kl_target=... --grpo.entropy_target=...`: the adaptive coefficients reach the run and its log."""

import json

import pytest

from ptx import cli


def test_adaptive_kl_and_entropy_coefficients_from_the_command_line(tmp_path):
  cli.main(["grpo", "--out", str(tmp_path), "--no-progress", "--model.n_layers=1", "--model.d_model=64",
            "--model.mlp_dim=128", "--train.steps=2", "--train.log_every=1", "--data.batch_size=8",
            "--grpo.group_size=2", "--grpo.beta=0.04", "--grpo.kl_placement=reward", "--grpo.kl_target=0.001",
            "--grpo.kl_horizon=16", "--grpo.entropy_coef=0.05", "--grpo.entropy_target=0.5",
            "--grpo.entropy_coef_delta=0.01", "--mesh.data=2", "--mesh.fsdp=4"])
  first, second = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  # Step 1 samples the reference policy (KL ~ 0 < target): beta falls by the clipped 20% (16 rollouts = horizon).
  assert first["actor/kl_coef"] == pytest.approx(0.04) and second["actor/kl_coef"] == pytest.approx(0.032)
  # A random byte model's entropy (~ln 264) is over the target: c_H applies to the first update only.
  assert first["actor/entropy"] > 0.5
  assert first["actor/entropy_coef"] == pytest.approx(0.05) and second["actor/entropy_coef"] == 0.0
