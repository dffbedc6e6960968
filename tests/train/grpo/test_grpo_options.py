"""GRPO's reward components and adaptive KL / entropy coefficients through the fused and host-reward steps."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stepping import run_steps
from tolerances import ADAM_EPS
from ptx.config import Config, DataConfig, GRPOConfig, MeshConfig, OptimizerConfig, TrainConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.tokenizer import ByteTokenizer
from ptx.train.grpo.prompts import PromptBatches
from ptx.sharding import make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.grpo import update
from ptx.train.job import grpo_job
from ptx.train.loop import fit
from ptx.data.lookahead import Lookahead
from ptx.train.grpo.host import HostRewardStep
from ptx.train.grpo.fused import make_grpo_step
from ptx.train.grpo.update import RLSpec, coefficient_stage
from ptx.train.state import init_state, state_shardings

TOK = ByteTokenizer()
N_NEW = 6
ROLLOUTS = 16  # 8 prompts x G = 2
# Parameters of two different programs after the same updates (components vs their weighted sum, adaptive vs fixed
# coefficients, host vs in-graph rewards): float32 rounding of reordered sums, kept small by ADAM_EPS (tolerances.py).
PARAMS_RTOL, PARAMS_ATOL = 1e-5, 1e-6


def _components(gen, task):
  """In-graph: two named components, the fraction of even tokens and the length used."""
  live = jnp.arange(gen.tokens.shape[1])[None] < gen.lengths[:, None]
  return {"even": ((gen.tokens % 2 == 0) & live).sum(axis=1) / jnp.maximum(gen.lengths, 1),
          "long": gen.lengths / N_NEW}


def _weighted_sum(gen, task):
  """The same reward as one scalar: even + 0.5 long."""
  parts = _components(gen, task)
  return parts["even"] + 0.5 * parts["long"]


def _components_on_host(tokens, lengths, tasks):
  """`_components` as Python on the host."""
  even = [np.mean(row[:n] % 2 == 0) if n else 0.0 for row, n in zip(tokens, lengths)]
  return {"even": np.asarray(even, np.float32), "long": np.asarray(lengths, np.float32) / N_NEW}


def _run(cfg, grpo_cfg, steps, *, reward=_components, host=False):
  """`steps` fused (or host-reward, on-policy) RL steps with the coefficient stage; (state, metrics per step)."""
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  optimizer = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0, eps=ADAM_EPS), 10)
  stage = coefficient_stage(grpo_cfg)
  optimizer = optimizer if stage is None else optax.chain(optimizer, stage)
  with_ref = grpo_cfg.beta > 0
  shardings = state_shardings(cfg, optimizer, mesh, with_reference=with_ref)
  state = init_state(cfg, optimizer, 0, mesh, with_reference=with_ref)
  kw = dict(max_new_tokens=N_NEW, stop_ids=(TOK.eos_id,), pad_id=TOK.pad_id)
  prompts = lambda width: PromptBatches(ArithmeticTask(0, 2), TOK, batch_size=8, prompt_len=8, answer_width=width)
  if host:
    data = Lookahead(prompts(None))
    step = HostRewardStep(spec=RLSpec(model=cfg, grpo=grpo_cfg, **kw), optimizer=optimizer, mesh=mesh,
                          state_shardings=shardings, reward=reward, prompts=data)
  else:
    data = prompts(4)
    step = make_grpo_step(RLSpec(model=cfg, grpo=grpo_cfg, **kw), reward, optimizer=optimizer, mesh=mesh,
                          state_shardings=shardings)
  return run_steps(step, state, data, steps)


def _coefficients(state):
  return jax.device_get(optax.tree_utils.tree_get(state.opt_state, "Coefficients"))


def test_reward_components_sum_to_the_scalar_reward_and_log_each_mean(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", reward_weights=(1.0, 0.5))
  parts, parts_metrics = _run(cfg, grpo_cfg, 1)
  scalar, scalar_metrics = _run(cfg, dataclasses.replace(grpo_cfg, reward_weights=()), 1, reward=_weighted_sum)
  m = parts_metrics[0]
  # Means of 16 float32 rewards, summed per component or as one: a few ulps apart.
  assert m["reward/mean"] == pytest.approx(m["reward/even/mean"] + 0.5 * m["reward/long/mean"], rel=1e-5)
  np.testing.assert_allclose(m["reward/mean"], scalar_metrics[0]["reward/mean"], rtol=1e-6)
  assert "reward/even/mean" not in scalar_metrics[0]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=PARAMS_RTOL,
                                                       atol=PARAMS_ATOL), parts.params, scalar.params)


def test_adaptive_coefficients_that_stay_put_equal_fixed_ones(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  fixed = GRPOConfig(group_size=2, kl_placement="reward", kl_estimator="k1", beta=0.1, entropy_coef=0.05)
  still = dataclasses.replace(fixed, kl_target=1.0, kl_horizon=10**15, entropy_target=1e9, entropy_coef_delta=0.0)
  want, want_metrics = _run(cfg, fixed, 1, reward=_weighted_sum)
  got, got_metrics = _run(cfg, still, 1, reward=_weighted_sum)
  for key in ("loss", "actor/entropy", "actor/pg_loss", "actor/kl_coef"):  # reordered float32 sums: ~1e-6
    np.testing.assert_allclose(got_metrics[0][key], want_metrics[0][key], rtol=1e-5, err_msg=key)
  assert got_metrics[0]["actor/entropy_coef"] == pytest.approx(0.05)  # float32 0.05: approx's rel 1e-6
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=PARAMS_RTOL,
                                                       atol=PARAMS_ATOL), got.params, want.params)


def test_gdpo_and_adaptive_coefficients_follow_their_rules_and_the_host_mode_equals_the_fused(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, reward_combine="normalize_then_sum", reward_weights=(1.0, 0.5),
                        kl_placement="reward", kl_estimator="k1", beta=0.1, kl_target=1e-4, kl_horizon=ROLLOUTS,
                        entropy_coef=0.01, entropy_target=1e9, entropy_coef_delta=0.004, entropy_coef_max=0.016,
                        max_staleness=0)
  fused, fused_metrics = _run(cfg, grpo_cfg, 3)
  host, host_metrics = _run(cfg, grpo_cfg, 3, reward=_components_on_host, host=True)
  betas, coefs = [0.1], [0.01]
  # The coefficients are float32 in the optimizer state, the rule's replay below float64: rel 1e-5 covers 3 steps.
  for m in fused_metrics:
    assert m["actor/kl_coef"] == pytest.approx(betas[-1], rel=1e-5)
    assert m["actor/entropy_coef"] == pytest.approx(coefs[-1], rel=1e-5)  # the entropy stays under the target
    error = np.clip(m["actor/reward_kl"] / 1e-4 - 1, -0.2, 0.2)  # horizon = one step's rollouts
    betas.append(betas[-1] * (1 + error))
    coefs.append(min(coefs[-1] + 0.004, 0.016))
    assert "reward/even/mean" in m and "reward/long/mean" in m
  assert betas[1] == pytest.approx(0.08)  # step 1 samples the reference policy: KL ~ 0, beta falls 20% (float64)
  final = _coefficients(fused)
  assert float(final.kl_coef) == pytest.approx(betas[-1], rel=1e-5)
  # Clipped at the maximum: float32 of 0.016, within approx's default rel 1e-6.
  assert float(final.entropy_coef) == pytest.approx(0.016) and float(final.entropy_on) == 1.0
  for want, got in zip(fused_metrics, host_metrics):
    for key in ("reward/mean", "reward/even/mean", "loss", "actor/kl_coef", "actor/entropy_coef"):
      # Host vs in-graph: reordered float32 sums, ~1e-6 relative; atol for a loss that lands near 0.
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=PARAMS_RTOL,
                                                       atol=PARAMS_ATOL), host.params, fused.params)


@pytest.mark.parametrize("bad, match", [
    (dict(kl_target=0.1, kl_placement="loss"), "kl_placement='reward'"),
    (dict(entropy_target=0.5, entropy_coef=2.0), "grpo.entropy_coef_min <= grpo.entropy_coef <= grpo.entropy_coef_max"),
    (dict(reward_combine="normalize_then_sum", advantage="rloo"), "GDPO"),
])
def test_bad_adaptive_configs_are_rejected_naming_the_field(tiny_config, bad, match):
  with pytest.raises(ValueError, match=match):
    RLSpec(model=tiny_config, grpo=GRPOConfig(**bad), max_new_tokens=4, stop_ids=(1,))


def test_adaptive_coefficients_need_the_coefficient_stage():
  params = {"w": jnp.zeros(3)}
  assert coefficient_stage(GRPOConfig()) is None
  state = coefficient_stage(GRPOConfig(kl_placement="reward", beta=0.2, kl_target=0.1)).init(params)
  # kl_coef, entropy_coef, entropy_on: float32 of 0.2 within approx's default rel 1e-6.
  assert [float(x) for x in state] == pytest.approx([0.2, 0.0, 1.0])
  with pytest.raises(ValueError, match="coefficient_stage"):
    update._coefficients(optax.adam(1.0).init(params))


def test_a_resumed_run_continues_with_the_checkpointed_coefficients(tmp_path, tiny_config):
  grpo_cfg = GRPOConfig(group_size=2, kl_placement="reward", beta=0.1, kl_target=1e-4, kl_horizon=ROLLOUTS,
                        entropy_coef=0.01, entropy_target=0.0, entropy_coef_delta=0.004)
  cfg = Config(model=dataclasses.replace(tiny_config, n_layers=1), mesh=MeshConfig(data=2, fsdp=4),
               optim=OptimizerConfig(lr=1e-3, warmup_steps=0), grpo=grpo_cfg,
               data=DataConfig(kind="rl", batch_size=8, seq_len=8, pack=False),
               train=TrainConfig(steps=2, log_every=1, checkpoint_every=1))
  job = grpo_job(cfg, TOK, _weighted_sum)
  assert job.with_reference and job.step.optimizer_stage() is not None
  run = lambda resume: fit(
      cfg, job, train_data=PromptBatches(ArithmeticTask(0, 2), TOK, batch_size=8, prompt_len=8, answer_width=4),
      out=tmp_path, progress=False, resume=resume)
  straight, _ = run(False)
  shutil.rmtree(tmp_path / "checkpoints" / "2")  # as if preempted after step 1
  resumed, summary = run(True)
  assert summary["resumed_from"] == 1 and int(resumed.step) == 2
  want = _coefficients(straight)
  # The coefficients moved (by 20% and 0.004) far past rounding, so the exact comparison below means something.
  assert float(want.kl_coef) != pytest.approx(0.1) and float(want.entropy_coef) != pytest.approx(0.01)
  jax.tree.map(np.testing.assert_array_equal, _coefficients(resumed), want)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), resumed.params,
               straight.params)


def _first_sample_of_odd_prompts(tokens, lengths, tasks):
  """Components where only prompts with an odd first operand give a group with signal."""
  odd = np.repeat([int(t["prompt"].split("+")[0]) % 2 for t in tasks], 2)
  return {"hit": (odd * (np.arange(len(odd)) % 2 == 0)).astype(np.float32), "zero": np.zeros(len(odd), np.float32)}


def test_host_refill_with_reward_components(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", max_staleness=1, filter_groups="refill",
                        max_refill_rounds=3)
  _, history = _run(cfg, grpo_cfg, 1, reward=_first_sample_of_odd_prompts, host=True)
  m = history[0]
  assert m["filter_groups/unfilled"] == 0.0 and m["filter_groups/rounds"] >= 2
  # Every kept group scores 1, 0: a mean of halves, exact in float32.
  assert m["reward/hit/mean"] == pytest.approx(0.5) and m["reward/zero/mean"] == 0.0
