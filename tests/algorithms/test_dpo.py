"""Preference losses: hand-computed values per variant, and a run that learns preferences."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptx.algorithms import dpo
from ptx.config import DPOConfig, MeshConfig, OptimizerConfig
from ptx.data.batch import pack_rows, sft_example
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import init_params
from ptx.sharding import make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.state import init_state, state_shardings
from ptx.train.step import make_train_step

# Two pairs: summed log-probs of policy and reference, and target counts.
CHOSEN, REJECTED = jnp.asarray([-4.0, -10.0]), jnp.asarray([-6.0, -9.0])
REF_CHOSEN, REF_REJECTED = jnp.asarray([-5.0, -9.5]), jnp.asarray([-5.5, -9.0])
N_CHOSEN, N_REJECTED = jnp.asarray([2.0, 5.0]), jnp.asarray([3.0, 3.0])


def _losses(**kw):
  cfg = DPOConfig(**kw)
  return np.asarray(dpo.preference_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, N_CHOSEN, N_REJECTED, cfg)[0])


def _log_sigmoid(x):
  return -np.log1p(np.exp(-x))


# The by-hand cases compare float32 losses of a few ops on exact inputs with float64 numpy: rtol 1e-6 is
# ~8 float32 ulps (log-sigmoid and a subtraction round once each); 1e-5 where a value is quoted to 6
# digits or the IPO case divides by lengths first; atol 1e-7 where the expected value is 0.


def test_sigmoid_dpo_by_hand():
  # z = beta * ((h_c - h_r) - (r_c - r_r)): pair 0: 0.1 * (2 - 0.5) = 0.15; pair 1: 0.1 * (-1 - (-0.5)) = -0.05.
  np.testing.assert_allclose(_losses(beta=0.1), [-_log_sigmoid(0.15), -_log_sigmoid(-0.05)], rtol=1e-6)
  np.testing.assert_allclose(_losses(beta=0.1)[0], 0.620957, rtol=1e-5)


def test_conservative_dpo_by_hand():
  z = np.asarray([0.15, -0.05])
  want = -0.8 * _log_sigmoid(z) - 0.2 * _log_sigmoid(-z)
  np.testing.assert_allclose(_losses(beta=0.1, label_smoothing=0.2), want, rtol=1e-6)


def test_hinge_by_hand():
  np.testing.assert_allclose(_losses(beta=0.1, loss_type="hinge"), [0.85, 1.05], rtol=1e-6)
  np.testing.assert_allclose(_losses(beta=10.0, loss_type="hinge"), [0.0, 6.0], rtol=1e-6)


def test_ipo_by_hand():
  # Length-averaged: pair 0: (-4/2 - -6/3) - (-5/2 - -5.5/3) = 0 - (-2/3) = 2/3; target 1 / (2 * 0.5) = 1.
  # pair 1: (-10/5 - -9/3) - (-9.5/5 - -9/3) = 1 - 1.1 = -0.1.
  np.testing.assert_allclose(_losses(beta=0.5, loss_type="ipo"), [(2 / 3 - 1) ** 2, (-0.1 - 1) ** 2], rtol=1e-5)


def test_simpo_by_hand():
  # Reference-free: beta * (avg_c - avg_r) - gamma; pair 0: 2 * (-2 + 2) - 0.5; pair 1: 2 * (-2 + 3) - 0.5.
  want = [-_log_sigmoid(-0.5), -_log_sigmoid(1.5)]
  np.testing.assert_allclose(_losses(beta=2.0, loss_type="simpo", simpo_gamma=0.5), want, rtol=1e-6)


def test_rewards_are_beta_times_the_log_ratio():
  _, chosen, rejected = dpo.preference_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, N_CHOSEN, N_REJECTED,
                                            DPOConfig(beta=0.1))
  np.testing.assert_allclose(chosen, [0.1, -0.05], rtol=1e-6)
  np.testing.assert_allclose(rejected, [-0.05, 0.0], atol=1e-7)


def _preference_batch(n, seed, filler=0):
  """n pairs, then `filler` empty rows as the batcher pads a short last batch with."""
  tok = ByteTokenizer()
  rng = np.random.default_rng(seed)
  chosen, rejected = [], []
  for _ in range(n):
    a, b = rng.integers(0, 50, 2)
    prompt = f"{a}+{b}="
    chosen.append(sft_example(tok, prompt, str(a + b)))
    rejected.append(sft_example(tok, prompt, "".join(rng.choice(list("xyzw"), 2))))
  rows = lambda examples: [[ex] for ex in examples] + [[]] * filler
  return {"chosen": pack_rows(rows(chosen), 16, tok.pad_id), "rejected": pack_rows(rows(rejected), 16, tok.pad_id)}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_padding_pairs_count_in_neither_the_loss_nor_any_metric(tiny_config, loss_type):
  params, ref_params = (init_params(tiny_config, jax.random.key(seed)) for seed in (0, 1))
  cfg = DPOConfig(loss_type=loss_type, beta=0.5)

  def metrics(batch):
    batch = dpo.prepare(ref_params, batch, model=tiny_config)
    return {k: float(v) for k, v in dpo.loss(params, batch, None, model=tiny_config, dpo=cfg)[1].items()}

  plain, padded = metrics(_preference_batch(2, 0)), metrics(_preference_batch(2, 0, filler=2))
  assert plain["weight"] == padded["weight"] == 2
  # The padded batch is another program (4 rows, not 2): float32 rounding of its reordered sums, ~1e-7 relative.
  assert padded == pytest.approx(plain, rel=1e-5, abs=1e-6)


def test_missing_reference_is_an_error(tiny_config):
  params = init_params(tiny_config, jax.random.key(0))
  with pytest.raises(ValueError, match="needs ref_chosen_logps"):
    dpo.loss(params, _preference_batch(2, 0), None, model=tiny_config, dpo=DPOConfig())


def test_a_dpo_run_learns_the_preferences(tiny_config):
  cfg = tiny_config
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  optimizer = make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=5, min_lr_ratio=1.0), 40)
  state = init_state(cfg, optimizer, 0, mesh, with_reference=True)
  dpo_cfg = DPOConfig(beta=0.5)
  step = make_train_step(functools.partial(dpo.loss, model=cfg, dpo=dpo_cfg), optimizer, mesh=mesh,
                         state_shardings=state_shardings(cfg, optimizer, mesh, with_reference=True),
                         prepare=functools.partial(dpo.prepare, model=cfg))
  first = None
  for i in range(40):
    state, metrics = step(state, _preference_batch(16, seed=i))
    first = first or {k: float(v) for k, v in metrics.items()}
  # Policy == reference at step 0, through two forwards of the same parameters that XLA may fuse differently: one
  # float32 rounding step of a sequence log-prob near -70 (3.8e-6), times beta, bounds the margin.
  assert first["rewards/margins"] == pytest.approx(0.0, abs=2e-5), "policy == reference at step 0"
  held_out = dpo.prepare(state.ref_params, _preference_batch(64, seed=1000), model=cfg)
  _, metrics = dpo.loss(state.params, held_out, None, model=cfg, dpo=dpo_cfg)
  assert float(metrics["rewards/accuracies"]) > 0.9, {k: float(v) for k, v in metrics.items()}
  assert float(metrics["rewards/margins"]) > 0
