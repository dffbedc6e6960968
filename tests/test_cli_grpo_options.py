"""`ptx grpo` options from the command line: adaptive KL and entropy coefficients, rollout temperature, PPO epochs
and mini-batches in one run, resumed with its coefficients; every KL placement and beta checked where it acts (the
Job, the step, the loss)."""

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from ptx import cli
from ptx.algorithms import grpo
from ptx.sharding import make_mesh
from ptx.train import presets
from ptx.train.grpo.fused import make_grpo_step
from ptx.train.optimizer import learning_rate_schedule
from ptx.train.state import abstract_state, init_state, initial_params, state_shardings

MODEL = ["--model.n_layers=1", "--model.d_model=64", "--model.mlp_dim=128"]
# Adaptive KL in the reward and adaptive entropy, tempered rollouts, 2 epochs x 2 mini-batches over a warmup; a
# checkpoint after each step.
OPTIONS = ["--no-progress", "--no-export", *MODEL, "--train.steps=2", "--train.log_every=1",
           "--train.checkpoint_every=1", "--data.batch_size=8", "--grpo.group_size=2", "--grpo.beta=0.04",
           "--grpo.kl_placement=reward", "--grpo.kl_target=0.001", "--grpo.kl_horizon=16", "--grpo.entropy_coef=0.05",
           "--grpo.entropy_target=0.5", "--grpo.entropy_coef_delta=0.01", "--grpo.sampling.temperature=0.8",
           "--optim.lr=0.001", "--optim.warmup_steps=8", "--grpo.epochs=2", "--grpo.minibatches=2", "--mesh.data=2",
           "--mesh.fsdp=4"]


def _records(out):
  return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def _checkpointed_state(out, step):
  """The train state a run checkpointed at `step`: parameters, and the optimizer state with the coefficients."""
  return ocp.StandardCheckpointer().restore((out / "checkpoints" / str(step) / "state").absolute())


def test_grpo_options_from_the_command_line_reach_the_run_and_a_resumed_run_keeps_its_coefficients(tmp_path, capsys):
  full, cut = tmp_path / "full", tmp_path / "cut"
  cli.main(["grpo", "--out", str(full), *OPTIONS])
  records = _records(full)
  first, second = records
  saved = json.loads((full / "config.json").read_text())["grpo"]
  assert saved["sampling"]["temperature"] == 0.8 and saved["minibatches"] == 2 and saved["epochs"] == 2
  assert [r["step"] for r in records] == [1, 2]
  # The sampler's log-probs and the first update's are both the policy's at temperature 0.8: two programs, ~1e-6
  # apart; 1e-4 catches a wrong temperature. The coefficients below are float32: pytest.approx's default rel 1e-6.
  assert first["rollout/logp_diff_max"] < 1e-4
  # Step 1 samples the reference policy (KL ~ 0 < target): beta falls by the clipped 20% (16 rollouts = horizon).
  assert first["actor/kl_coef"] == pytest.approx(0.04) and second["actor/kl_coef"] == pytest.approx(0.032)
  # A random byte model's entropy (~ln 264) is over the target: c_H applies to the first update only, and a step
  # logs the mean of its 4 updates' c_H.
  assert first["actor/entropy"] > 0.5
  assert first["actor/entropy_coef"] == pytest.approx(0.05 / 4) and second["actor/entropy_coef"] == 0.0
  # A step logs the lr of its first update; 2 epochs x 2 mini-batches make 4 updates a step, 8 in the run.
  schedule = learning_rate_schedule(dataclasses.replace(presets.TOY["grpo"]().optim, lr=0.001, warmup_steps=8), 8)
  # The same float32 schedule logged and recomputed: rounding only; the first update's lr is 0 (abs, not rel).
  assert first["lr"] == pytest.approx(float(schedule(0)), abs=1e-9)
  assert second["lr"] == pytest.approx(float(schedule(4))) and second["lr"] != pytest.approx(float(schedule(1)))
  # The KL term with its reference (this run's cell of the placement x beta matrix below) trains end to end.
  assert all(r["actor/grad_norm"] > 0 and np.isfinite(r["loss"]) for r in records)

  # Preempted after step 1's checkpoint, then resumed: step 2 adapts from the checkpointed coefficients (beta 0.032
  # above, not the configured 0.04) and ends where the uninterrupted run did, bit for bit.
  shutil.copytree(full, cut)
  shutil.rmtree(cut / "checkpoints" / "2")
  capsys.readouterr()
  cli.main(["grpo", "--out", str(cut), "--resume", *OPTIONS])
  assert "resumed from checkpoint step 1" in capsys.readouterr().out
  wall_clock = ("steps_per_s", "samples_per_s", "tokens_per_s", "timing_s/", "perf/")
  drop = lambda r: {k: v for k, v in r.items() if not k.startswith(wall_clock)}
  assert [drop(r) for r in _records(cut)] == [drop(r) for r in records]
  jax.tree.map(np.testing.assert_array_equal, _checkpointed_state(cut, 2), _checkpointed_state(full, 2))


def test_bad_ppo_epochs_and_minibatches_from_the_command_line_are_refused(tmp_path, capsys):
  args = ["grpo", "--out", str(tmp_path), "--no-progress", *MODEL, "--data.batch_size=8", "--grpo.group_size=2"]
  with pytest.raises(SystemExit):
    cli.main(args + ["--grpo.epochs=2", "--grpo.minibatches=3"])
  assert "grpo.minibatches=3 must divide data.batch_size=8" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(args + ["--grpo.epochs=0"])
  assert "--grpo.epochs: grpo.epochs and grpo.minibatches must be >= 1" in capsys.readouterr().err


def _zero_reward_rows(spec, rows=8, columns=12):
  """Fixed scored rollouts of a model that earns no reward (a random one on arithmetic): every advantage 0."""
  mask = np.zeros((rows, columns), np.int32)
  mask[:, 4:] = 1  # 4 prompt tokens, 8 sampled
  logps = np.full((rows, columns), -5.5, np.float32)  # ~ln(1 / 264): the random policy's, and its reference's
  batch = {"tokens": np.random.default_rng(0).integers(3, spec.model.vocab_size, (rows, columns), dtype=np.int32),
           "positions": np.tile(np.arange(columns, dtype=np.int32), (rows, 1)), "segment_ids": np.ones_like(mask),
           "loss_mask": mask, "old_logps": logps, "ref_logps": logps, "advantages": np.zeros(rows, np.float32)}
  return {**batch, **grpo.aggregation_inputs(jnp.asarray(mask), spec.grpo)}


@pytest.mark.parametrize("placement", ["none", "loss", "reward"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_every_kl_placement_and_beta_builds_a_step_that_references_and_trains_as_it_should(tmp_path, placement, beta):
  # The Job `ptx grpo` builds for the options (tests/test_jobs_agree.py: the library builds the same one).
  args, overrides = cli._parser().parse_known_args([
      "grpo", "--out", str(tmp_path), *MODEL, "--data.batch_size=4", "--grpo.group_size=2",
      f"--grpo.kl_placement={placement}", f"--grpo.beta={beta}", "--grpo.entropy_coef=0.05", "--mesh.data=2",
      "--mesh.fsdp=2", "--mesh.tensor=2"])
  cfg, _, _, job, train, *_ = cli._prepare(args, overrides)
  uses_reference = placement != "none" and beta > 0
  spec = job.step.spec
  assert job.with_reference is uses_reference and (spec.grpo.kl_placement, spec.grpo.beta) == (placement, beta)
  # Its fused step, traced (not compiled) as `fit` builds it: the KL coefficient is logged exactly when a reference
  # exists.
  mesh, optimizer = make_mesh(cfg.mesh), job.optimizer()
  shardings = state_shardings(job.model, optimizer, mesh, job.rules, with_reference=job.with_reference)
  state = abstract_state(shardings, lambda: init_state(job.model, optimizer, 0, mesh, job.rules,
                                                       with_reference=job.with_reference))
  step = make_grpo_step(spec, job.step.reward_fn, optimizer=optimizer, mesh=mesh, state_shardings=shardings)
  _, metrics = jax.eval_shape(step, state, next(train))
  assert ("actor/kl_coef" in metrics) is uses_reference and "actor/grad_norm" in metrics
  # Its loss where no sample earns a reward: the entropy bonus moves the weights in any case, the loss finite.
  loss_fn = functools.partial(grpo.loss, model=spec.model, grpo=spec.grpo)

  @jax.jit
  def grad_norm_and_loss(params, batch):
    grads, aux = jax.grad(loss_fn, has_aux=True)(params, batch, jax.random.key(1))
    return optax.tree.norm(grads), aux["loss"]

  norm, loss = grad_norm_and_loss(initial_params(spec.model, 0), _zero_reward_rows(spec))
  assert float(norm) > 0 and np.isfinite(float(loss))
