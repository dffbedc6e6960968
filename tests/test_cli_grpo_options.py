"""`ptx grpo` options from the command line: adaptive KL and entropy coefficients, rollout temperature, PPO epochs
and mini-batches."""

import dataclasses
import json

import numpy as np
import pytest

from ptx import cli
from ptx.train import presets
from ptx.train.optimizer import learning_rate_schedule


def test_adaptive_kl_and_entropy_coefficients_and_rollout_temperature_from_the_command_line(tmp_path):
  cli.main(["grpo", "--out", str(tmp_path), "--no-progress", "--model.n_layers=1", "--model.d_model=64",
            "--model.mlp_dim=128", "--train.steps=2", "--train.log_every=1", "--data.batch_size=8",
            "--grpo.group_size=2", "--grpo.beta=0.04", "--grpo.kl_placement=reward", "--grpo.kl_target=0.001",
            "--grpo.kl_horizon=16", "--grpo.entropy_coef=0.05", "--grpo.entropy_target=0.5",
            "--grpo.entropy_coef_delta=0.01", "--grpo.sampling.temperature=0.8", "--mesh.data=2", "--mesh.fsdp=4"])
  first, second = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert json.loads((tmp_path / "config.json").read_text())["grpo"]["sampling"]["temperature"] == 0.8
  # The sampler's log-probs and the first update's are both the policy's at temperature 0.8: two programs, ~1e-6
  # apart; 1e-4 catches a wrong temperature. The coefficients below are float32: pytest.approx's default rel 1e-6.
  assert first["rollout/logp_diff_max"] < 1e-4
  # Step 1 samples the reference policy (KL ~ 0 < target): beta falls by the clipped 20% (16 rollouts = horizon).
  assert first["actor/kl_coef"] == pytest.approx(0.04) and second["actor/kl_coef"] == pytest.approx(0.032)
  # A random byte model's entropy (~ln 264) is over the target: c_H applies to the first update only.
  assert first["actor/entropy"] > 0.5
  assert first["actor/entropy_coef"] == pytest.approx(0.05) and second["actor/entropy_coef"] == 0.0


def test_ppo_epochs_and_minibatches_from_the_command_line_span_the_lr_schedule(tmp_path, capsys):
  args = ["grpo", "--out", str(tmp_path), "--no-progress", "--model.n_layers=1", "--model.d_model=64",
          "--model.mlp_dim=128", "--train.steps=2", "--train.log_every=1", "--data.batch_size=8",
          "--grpo.group_size=2", "--optim.lr=0.001", "--optim.warmup_steps=8", "--mesh.data=2", "--mesh.fsdp=4"]
  with pytest.raises(SystemExit):
    cli.main(args + ["--grpo.epochs=2", "--grpo.minibatches=3"])
  assert "grpo.minibatches=3 must divide data.batch_size=8" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(args + ["--grpo.epochs=0"])
  assert "--grpo.epochs: grpo.epochs and grpo.minibatches must be >= 1" in capsys.readouterr().err
  cli.main(args + ["--grpo.epochs=2", "--grpo.minibatches=2"])
  first, second = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  # A step logs the lr of its first update; 2 epochs x 2 mini-batches make 4 updates a step, 8 in the run.
  schedule = learning_rate_schedule(dataclasses.replace(presets.TOY["grpo"]().optim, lr=0.001, warmup_steps=8), 8)
  # The same float32 schedule logged and recomputed: rounding only; the first update's lr is 0 (abs, not rel).
  assert first["lr"] == pytest.approx(float(schedule(0)), abs=1e-9)
  assert second["lr"] == pytest.approx(float(schedule(4))) and second["lr"] != pytest.approx(float(schedule(1)))
  assert json.loads((tmp_path / "config.json").read_text())["grpo"]["minibatches"] == 2


@pytest.mark.parametrize("placement", ["none", "loss", "reward"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_every_kl_placement_and_beta_runs_two_steps_from_the_command_line(tmp_path, placement, beta):
  cli.main(["grpo", "--out", str(tmp_path), "--no-progress", "--no-export", "--model.n_layers=1",
            "--model.d_model=64", "--model.mlp_dim=128", "--train.steps=2", "--train.log_every=1",
            "--data.batch_size=4", "--grpo.group_size=2", f"--grpo.kl_placement={placement}", f"--grpo.beta={beta}",
            "--grpo.entropy_coef=0.05", "--mesh.data=2", "--mesh.fsdp=2", "--mesh.tensor=2"])
  records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2]
  uses_reference = placement != "none" and beta > 0
  # The KL coefficient is logged exactly when a reference exists; the entropy bonus moves the weights in any case.
  assert all(("actor/kl_coef" in r) is uses_reference for r in records)
  assert all(r["actor/grad_norm"] > 0 and np.isfinite(r["loss"]) for r in records)
