"""The GRPO family against docs/grpo-loss.md: test vectors, clipping, aggregation invariance."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tolerances import assert_close_to_scale
from ptx.algorithms import advantages as adv_lib
from ptx.algorithms import grpo
from ptx.config import GRPO_PRESETS, GRPOConfig
from ptx.models import init_params
from ptx.models.chunked_logits import logit_stats
from ptx.train.step import accumulate_gradients

# By-hand values are float32 results of a few operations against exact numbers: rtol 1e-6 is ~8 float32 ulps.
# Against the spec's 6-decimal literals, or where the estimator's std + eps (1e-6) shifts the value by ~1e-6
# relative, rtol 1e-5. Without a tolerance (assert_allclose's rtol 1e-7): small binary fractions, exact in float32.


def _adv(rewards, estimator="grpo", group_size=4, **kw):
  return np.asarray(adv_lib.advantages(jnp.asarray(rewards, jnp.float32), group_size, estimator, eps=0.0, **kw))


def test_spec_advantage_vectors():
  np.testing.assert_allclose(_adv([1, 0, 1, 0]), [0.866025, -0.866025, 0.866025, -0.866025], rtol=1e-5)
  np.testing.assert_allclose(_adv([1, 1, 1, 0]), [0.5, 0.5, 0.5, -1.5], rtol=1e-5)
  np.testing.assert_allclose(_adv([1, 1, 1, 0], "grpo_no_std"), [0.25, 0.25, 0.25, -0.75], rtol=1e-6)


def test_rloo_is_leave_one_out():
  r = [1.0, 0.0, 2.0, 5.0]
  want = [r[i] - np.mean([r[j] for j in range(4) if j != i]) for i in range(4)]
  np.testing.assert_allclose(_adv(r, "rloo"), want, rtol=1e-6)


def test_zero_variance_groups_nan_rewards_and_single_samples():
  a = np.asarray(adv_lib.advantages(jnp.asarray([1.0, 1.0, 1.0, 1.0, 0.0, 1.0]), 2, "grpo"))
  np.testing.assert_array_equal(a[:4], 0.0)  # exactly 0, any eps
  with_nan = _adv([1.0, np.nan, 0.0, 1.0], "grpo_no_std")
  np.testing.assert_allclose(with_nan, [1 / 3, 0.0, -2 / 3, 1 / 3], rtol=1e-6)  # NaN left out of the mean
  np.testing.assert_allclose(_adv([3.0, -1.0], group_size=1), [3.0, -1.0])  # exact: a group of one keeps its reward


def test_batch_std_and_reinforce_pp_baseline():
  r = [1.0, 0.0, 1.0, 1.0]
  batch_std = np.std(r, ddof=1)
  centred = np.asarray([0.5, -0.5, 0.0, 0.0])
  np.testing.assert_allclose(_adv(r, "grpo_batch_std", group_size=2), centred / batch_std, rtol=1e-6)
  lengths = np.asarray([1, 3, 2, 2])
  tokens = np.repeat(centred, lengths)
  want = (centred - tokens.mean()) / tokens.std(ddof=1)
  got = _adv(r, "reinforce_pp_baseline", group_size=2, lengths=jnp.asarray(lengths))
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_overlong_punishment_dapo_eq13():
  got = adv_lib.overlong_punishment(jnp.asarray([100, 16384, 18432, 20480, 20481]), 20480, 4096)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -1.0])


def test_dynamic_sampling_keeps_groups_with_signal():
  keep = adv_lib.groups_with_signal(jnp.asarray([1, 1, 0, 1, 0, 0, 1, 1]), 2)
  np.testing.assert_array_equal(keep, [False, True, False, False])


MASK = jnp.asarray([[0, 1, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]])


@pytest.mark.parametrize("mode, want_row_sums", [
    ("token_mean", [3 / 6, 1 / 6, 0, 2 / 6]),
    ("seq_mean_token_mean", [1 / 3, 1 / 3, 0, 1 / 3]),
    ("seq_mean_token_sum", [3 / 3, 1 / 3, 0, 2 / 3]),
    ("seq_mean_token_sum_norm", [3 / 30, 1 / 30, 0, 2 / 30]),
    ("prompt_mean", [3 / 4 / 2, 1 / 4 / 2, 0, 2 / 2 / 2]),
])
def test_aggregation_weights(mode, want_row_sums):
  w = grpo.aggregation_weights(MASK, mode, group_size=2, max_tokens=10)
  np.testing.assert_allclose(w.sum(axis=1), want_row_sums, rtol=1e-6)
  assert np.all(np.asarray(w)[np.asarray(MASK) == 0] == 0)


def test_kl_estimators():
  logp, ref = jnp.asarray([-1.0, -2.0]), jnp.asarray([-1.5, -1.0])
  d = np.asarray([0.5, -1.0])
  np.testing.assert_allclose(grpo.kl_estimate(logp, ref, "k1"), d)
  np.testing.assert_allclose(grpo.kl_estimate(logp, ref, "k2"), 0.5 * d**2)
  np.testing.assert_allclose(grpo.kl_estimate(logp, ref, "k3"), np.exp(-d) + d - 1, rtol=1e-6)
  # k3+: k3's value with k2's gradient d(delta^2 / 2)/d logp = delta.
  np.testing.assert_allclose(grpo.kl_estimate(logp, ref, "k3+"), np.exp(-d) + d - 1, rtol=1e-6)
  grad = jax.grad(lambda l: grpo.kl_estimate(l, ref, "k3+").sum())(logp)
  np.testing.assert_allclose(grad, d, rtol=1e-6)


def test_log_probs_and_entropy_are_the_policys_at_the_rollout_temperature():
  logits = jax.random.normal(jax.random.key(0), (2, 5, 7)) * 3.0
  tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, 7)
  for temperature in (1.0, 0.6):
    logp_all = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64) / temperature, axis=-1))
    want = np.take_along_axis(logp_all[:, :-1], np.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]
    got = logit_stats(logits[:, :-1], tokens[:, 1:], temperature)
    # float32 log-softmax against float64: log-probs down to -20 (logits to 12 / 0.6), ulp 2e-6, so ~5 ulps.
    np.testing.assert_allclose(np.asarray(got.log_probs), want, atol=1e-5)
    entropy = -(np.exp(logp_all) * logp_all).sum(-1)[:, :-1]  # as above
    np.testing.assert_allclose(np.asarray(got.entropy), entropy, atol=1e-5)


def test_ppo_clip_dapo_and_dual_clip_by_hand():
  old = jnp.zeros((1, 4))
  logps = jnp.log(jnp.asarray([[1.5, 0.5, 1.1, 3.0]]))  # ratios
  adv = jnp.asarray([[1.0, -1.0, 1.0, -1.0]])
  mask = jnp.ones((1, 4))
  rho, stats = grpo.surrogate(logps, old, adv, mask, GRPOConfig(epsilon_low=0.2, epsilon_high=0.28))
  # A>0, r=1.5: -min(1.5, 1.28) = -1.28; A<0, r=0.5: -min(-0.5, -0.8) = 0.8; r=1.1 unclipped; A<0, r=3: 3.
  np.testing.assert_allclose(rho, [[-1.28, 0.8, -1.1, 3.0]], rtol=1e-6)
  np.testing.assert_array_equal(stats["actor/clip_high"], [[True, False, False, False]])
  np.testing.assert_array_equal(stats["actor/clip_low"], [[False, True, False, False]])
  dual, _ = grpo.surrogate(logps, old, adv, mask, GRPOConfig(dual_clip=2.0))
  np.testing.assert_allclose(dual[0, 3], 2.0)  # min(3, -c A) with c = 2


def test_gspo_uses_one_ratio_per_sequence_and_cispo_clips_without_gradient_through_the_ratio():
  old = jnp.zeros((1, 3))
  logps = jnp.asarray([[0.1, -0.1, 0.3]])
  mask = jnp.ones((1, 3))
  adv = jnp.ones((1, 3))
  cfg = GRPOConfig(surrogate="gspo", epsilon_low=1.0, epsilon_high=1.0)
  rho, _ = grpo.surrogate(logps, old, adv, mask, cfg)
  np.testing.assert_allclose(rho, -np.exp(0.1) * np.ones((1, 3)), rtol=1e-6)  # exp(mean log-ratio)
  cispo = GRPOConfig(surrogate="cispo", epsilon_high=0.1)
  grad = jax.grad(lambda l: grpo.surrogate(l, old, adv, mask, cispo)[0].sum())(logps)
  np.testing.assert_allclose(grad, -np.clip(np.exp(logps), 0.8, 1.1), rtol=1e-6)


def test_importance_weights_token_and_sequence_mask():
  old = jnp.log(jnp.asarray([[1.0, 4.0, 1.0], [1.0, 1.0, 1.0]]))
  sampler = jnp.zeros((2, 3))
  mask = jnp.asarray([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
  token = GRPOConfig(tis_cap=3.0)
  np.testing.assert_allclose(grpo.importance_weights(old, sampler, mask, token), [[1, 3, 1], [1, 1, 1]], rtol=1e-6)
  # Row 0's sequence ratio is exp(mean(log 1, log 4)) = 2 over its two response tokens.
  seq = GRPOConfig(tis_cap=1.5, tis_mode="sequence_mask", tis_min=0.5)
  np.testing.assert_array_equal(grpo.importance_weights(old, sampler, mask, seq), [[0, 0, 0], [1, 1, 1]])
  # The product over row 0's response tokens is 4: outside [0.5, 5] only for a cap below it; kept, it weighs 4.
  product = GRPOConfig(tis_cap=5.0, tis_mode="sequence_product_mask", tis_min=0.5)
  np.testing.assert_allclose(grpo.importance_weights(old, sampler, mask, product), [[4, 4, 4], [1, 1, 1]], rtol=1e-6)
  capped = GRPOConfig(tis_cap=3.0, tis_mode="sequence_product_mask")
  np.testing.assert_array_equal(grpo.importance_weights(old, sampler, mask, capped), [[0, 0, 0], [1, 1, 1]])
  with pytest.raises(ValueError, match="grpo.tis_min must be in"):
    GRPOConfig(tis_cap=1.0, tis_min=2.0)


def test_presets_follow_the_spec_table():
  assert GRPO_PRESETS["dapo"].epsilon_high == 0.28 and GRPO_PRESETS["dapo"].beta == 0.0
  assert GRPO_PRESETS["dr_grpo"].advantage == "grpo_no_std"
  assert GRPO_PRESETS["dr_grpo"].loss_agg_mode == "seq_mean_token_sum_norm"
  assert GRPO_PRESETS["gspo"].surrogate == "gspo" and GRPO_PRESETS["grpo_paper"].beta == 0.04
  assert GRPO_PRESETS["reinforce_pp_baseline"].advantage == "reinforce_pp_baseline"
  assert GRPO_PRESETS["dapo"].filter_groups == "refill" and GRPO_PRESETS["dapo"].overlong_buffer == 4096


def _rollout_batch(cfg_model, grpo_cfg, n=8, s=12, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, s - 4, n)  # some sequences generate nothing
  mask = (np.arange(s)[None] >= 4) & (np.arange(s)[None] < 4 + lengths[:, None])
  batch = {
      "tokens": rng.integers(3, cfg_model.vocab_size, (n, s)).astype(np.int32),
      "positions": np.tile(np.arange(s, dtype=np.int32), (n, 1)),
      "segment_ids": np.ones((n, s), np.int32),
      "loss_mask": mask.astype(np.int32),
      "old_logps": (rng.normal(size=(n, s)) * 0.1 - 5.5).astype(np.float32),
      "ref_logps": (rng.normal(size=(n, s)) * 0.1 - 5.5).astype(np.float32),
      "advantages": np.asarray(adv_lib.advantages(jnp.asarray(rng.integers(0, 2, n).astype(np.float32)),
                                                  grpo_cfg.group_size, "grpo")),
  }
  return {**batch, **jax.tree.map(np.asarray, grpo.aggregation_inputs(jnp.asarray(mask), grpo_cfg))}


@pytest.mark.parametrize("mode", grpo.AGGREGATIONS)
def test_every_aggregation_mode_is_invariant_to_the_micro_batch_split(tiny_config, mode):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, loss_agg_mode=mode, beta=0.04, entropy_coef=0.01, max_response_tokens=8,
                        dual_clip=3.0)
  params = init_params(cfg, jax.random.key(0))
  batch = _rollout_batch(cfg, grpo_cfg)
  loss_fn = functools.partial(grpo.loss, model=cfg, grpo=grpo_cfg)
  results = {k: jax.jit(accumulate_gradients, static_argnums=(0, 4))(loss_fn, params, batch, jax.random.key(1), k)
             for k in (1, 2, 4)}
  (g1, m1) = results[1]
  for k in (2, 4):
    gk, mk = results[k]
    # Micro-batches sum the loss and the gradients in another order: float32 rounding, ~1e-6 relative. Gradients are
    # within 1.6e-6 of each leaf's largest entry; rtol 1e-4 with atol 1e-7 on each entry came within 85% (token_sum).
    np.testing.assert_allclose(mk["loss"], m1["loss"], rtol=1e-5, err_msg=f"{mode}, {k} micro-batches")
    jax.tree.map(lambda a, b: assert_close_to_scale(a, b, 1e-5), gk, g1)
  # The whole-batch loss is exactly sum(w * per-token terms); the weight is a float32 sum (approx's rel 1e-6).
  assert np.isfinite(float(m1["loss"])) and float(m1["weight"]) == pytest.approx(float(batch["agg_total"][0]))


def test_reward_components_sum_then_normalize_and_gdpo_normalize_then_sum_by_hand():
  rewards = {"b_format": jnp.asarray([0.0, 1.0, 0.0, 0.0]), "a_correct": jnp.asarray([1.0, 0.0, 1.0, 1.0])}
  weights = adv_lib.component_weights(rewards, (1.0, 0.5))  # sorted names: a_correct 1.0, b_format 0.5
  total = adv_lib.total_reward(rewards, (1.0, 0.5))
  np.testing.assert_allclose(total, [1.0, 0.5, 1.0, 1.0])
  np.testing.assert_allclose(adv_lib.advantages(total, 2, "grpo"), [0.707107, -0.707107, 0.0, 0.0],
                             rtol=1e-5)  # 6 decimals, and std + eps
  # GDPO: a_correct -> [+0.7071, -0.7071, 0, 0], b_format -> [-0.7071, +0.7071, 0, 0] per group; 1 a + 0.5 b =
  # [0.3536, -0.3536, 0, 0], then over the batch: mean 0, unbiased std sqrt(0.25 / 3) -> +-sqrt(1.5).
  gdpo = adv_lib.normalize_then_sum(adv_lib.components(rewards), weights, 2)
  np.testing.assert_allclose(gdpo, [1.224745, -1.224745, 0.0, 0.0], rtol=1e-5)  # 6 decimals; two std + eps
  with_nan = {**rewards, "b_format": jnp.asarray([0.0, 1.0, np.nan, 0.0])}  # unscorable in one component
  assert float(adv_lib.normalize_then_sum(adv_lib.components(with_nan), weights, 2)[2]) == 0.0
  assert np.isnan(float(adv_lib.total_reward(with_nan)[2]))


def test_reward_weights_must_match_the_components():
  with pytest.raises(ValueError, match=r"2 weights for the reward components \['a', 'b', 'c'\]"):
    adv_lib.total_reward({k: jnp.zeros(2) for k in "cab"}, (1.0, 2.0))
  with pytest.raises(ValueError, match="no named components"):
    adv_lib.total_reward(jnp.zeros(2), (1.0,))
  np.testing.assert_array_equal(adv_lib.total_reward(jnp.asarray([1.0, 2.0])), [1.0, 2.0])


def test_adaptive_kl_coefficient_follows_verl_rule():
  cfg = GRPOConfig(kl_placement="reward", beta=0.1, kl_target=0.05, kl_horizon=1000)
  # float32 arithmetic, a few operations deep, against float64: pytest.approx's default rel 1e-6.
  coef = lambda kl: float(grpo.adaptive_kl_coef(jnp.float32(0.1), jnp.float32(kl), 100, cfg))
  assert coef(0.055) == pytest.approx(0.1 * (1 + 0.1 * 100 / 1000))  # KL 10% over target
  assert coef(0.5) == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))  # error clipped at +0.2
  assert coef(0.0) == pytest.approx(0.1 * (1 - 0.2 * 100 / 1000))  # and at -0.2


def test_adaptive_entropy_coefficient_moves_by_delta_within_bounds():
  cfg = GRPOConfig(entropy_coef=0.01, entropy_target=0.3, entropy_coef_delta=0.004, entropy_coef_min=0.002,
                   entropy_coef_max=0.012)
  coef = lambda c, h: float(grpo.adaptive_entropy_coef(jnp.float32(c), jnp.float32(h), cfg))  # float32: rel 1e-6
  assert coef(0.005, 0.2) == pytest.approx(0.009)  # entropy below target: up
  assert coef(0.005, 0.3) == pytest.approx(0.009)  # at the target counts as below
  assert coef(0.01, 0.2) == pytest.approx(0.012)  # capped at the maximum
  assert coef(0.01, 0.4) == pytest.approx(0.006)  # above target: down
  assert coef(0.004, 0.4) == pytest.approx(0.002)  # floored at the minimum


def test_an_entropy_coefficient_in_the_batch_replaces_the_configs(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  fixed = GRPOConfig(group_size=2, entropy_coef=0.03, max_response_tokens=8)
  params = init_params(cfg, jax.random.key(0))
  batch = _rollout_batch(cfg, fixed)
  grad = lambda g, b: jax.jit(jax.grad(functools.partial(grpo.loss, model=cfg, grpo=g), has_aux=True))(
      params, b, jax.random.key(1))
  want, want_metrics = grad(fixed, batch)
  got, got_metrics = grad(dataclasses.replace(fixed, entropy_coef=0.0),
                          {**batch, "entropy_coef": np.full(8, 0.03, np.float32)})
  # The same terms with the coefficient read from the batch instead of folded in as a constant: float32 rounding
  # at most (bit-equal here).
  np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), got, want)
