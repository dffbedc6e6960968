"""GRPO's reward components and adaptive KL / entropy coefficients through the fused and host-reward steps."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_steps import MODEL, N_NEW, build
from ptx.config import GRPOConfig
from ptx.train.grpo import update
from ptx.train.grpo.update import RLSpec, coefficient_stage

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


def _run(grpo_cfg, steps, *, reward=_components, kind="fused"):
  """`steps` fused (or host-reward, on-policy) RL steps with the coefficient stage; (state, metrics per step)."""
  return build(MODEL, grpo_cfg, reward, kind=kind).run(steps)


def _coefficients(state):
  return jax.device_get(optax.tree_utils.tree_get(state.opt_state, "Coefficients"))


def _assert_params_close(got, want):
  """The parameters of two programs after the same updates: within PARAMS_RTOL / PARAMS_ATOL."""
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=PARAMS_RTOL,
                                                       atol=PARAMS_ATOL), got, want)


def test_reward_components_and_adaptive_coefficients_that_stay_put_equal_a_scalar_reward_and_fixed_ones():
  # One comparison for two equivalences: the components' weighted sum is the scalar reward, and adaptive coefficients
  # whose rules cannot move them (a huge horizon, no entropy step) are the fixed coefficients.
  fixed = GRPOConfig(group_size=2, kl_placement="reward", kl_estimator="k1", beta=0.1, entropy_coef=0.05)
  still = dataclasses.replace(fixed, reward_weights=(1.0, 0.5), kl_target=1.0, kl_horizon=10**15, entropy_target=1e9,
                              entropy_coef_delta=0.0)
  want, want_metrics = _run(fixed, 1, reward=_weighted_sum)
  got, got_metrics = _run(still, 1)
  m, w = got_metrics[0], want_metrics[0]
  # Means of 16 float32 rewards, summed per component or as one: a few ulps apart.
  assert m["reward/mean"] == pytest.approx(m["reward/even/mean"] + 0.5 * m["reward/long/mean"], rel=1e-5)
  np.testing.assert_allclose(m["reward/mean"], w["reward/mean"], rtol=1e-6)
  assert "reward/even/mean" not in w
  for key in ("loss", "actor/entropy", "actor/pg_loss", "actor/kl_coef"):  # reordered float32 sums: ~1e-6
    np.testing.assert_allclose(m[key], w[key], rtol=1e-5, err_msg=key)
  assert m["actor/entropy_coef"] == pytest.approx(0.05)  # float32 0.05: approx's rel 1e-6
  _assert_params_close(got.params, want.params)


def test_gdpo_and_adaptive_coefficients_follow_their_rules_and_the_host_mode_equals_the_fused():
  grpo_cfg = GRPOConfig(group_size=2, reward_combine="normalize_then_sum", reward_weights=(1.0, 0.5),
                        kl_placement="reward", kl_estimator="k1", beta=0.1, kl_target=1e-4, kl_horizon=ROLLOUTS,
                        entropy_coef=0.01, entropy_target=1e9, entropy_coef_delta=0.004, entropy_coef_max=0.016,
                        max_staleness=0)
  fused, fused_metrics = _run(grpo_cfg, 3)
  host, host_metrics = _run(grpo_cfg, 3, reward=_components_on_host, kind="host")
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
  _assert_params_close(host.params, fused.params)


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
