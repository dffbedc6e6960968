"""Int8 rollout parameters: per-channel error bound, the training arrays untouched, int8 bytes, logits near the float
forward's, shardings that follow the weights', adapters refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from ptx.config import LoRAConfig, MeshConfig
from ptx.models import int8_weights, lora
from ptx.models.decoder import forward
from ptx.models.params import init_params, param_shardings
from ptx.models.rollout_params import rollout_params, rollout_shardings
from ptx.sharding import make_mesh

_forward = jax.jit(forward, static_argnames="cfg")
_rollout = jax.jit(rollout_params, static_argnames="cfg")
PROJECTIONS = tuple(lora.INPUT_AXES)


def _tokens(cfg, batch=2, seq=9):
  return jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq)), jnp.int32)


def test_dequantised_weight_is_within_half_a_step_of_its_channel():
  # [L, D, H, K], channels of 6 magnitudes
  w = jax.random.normal(jax.random.key(0), (3, 20, 4, 6)) * jnp.arange(1.0, 7.0)[None, None, None]
  q = int8_weights.quantize(w, contracted=(1,))
  assert q.qvalue.dtype == jnp.int8 and q.scale.shape == (3, 1, 4, 6)
  absmax = np.asarray(jnp.max(jnp.abs(w), axis=1, keepdims=True))
  step = absmax / 127  # symmetric: the channel's max is +-127 steps
  np.testing.assert_allclose(q.scale, step, rtol=1e-6)  # float32 division and product: an ulp or two
  np.testing.assert_array_equal(np.abs(q.qvalue).max(axis=1, keepdims=True), 127)
  err = np.abs(np.asarray(qwix.dequantize(q)) - np.asarray(w))
  # Round to nearest: half a step per element, plus float32 rounding of w / scale and qvalue * scale (ulps of the
  # channel's max).
  assert np.all(err <= step / 2 + 4 * np.finfo(np.float32).eps * absmax)


def test_training_params_stay_float_and_unchanged(tiny_config):
  params = init_params(tiny_config, jax.random.key(0))
  before = jax.tree.map(np.array, params)
  leaves = jax.tree.leaves(params)
  rollout = _rollout(params, tiny_config)
  after = jax.tree.leaves(params)
  assert all(a is b for a, b in zip(leaves, after))  # the same arrays
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, params))  # holding the same values
  assert all(not x.is_deleted() for x in after)
  # The rollout tree's projections are int8: a quarter of the float32 bytes plus one scale per output channel.
  for name in PROJECTIONS:
    q, w = rollout["layers"][name], params["layers"][name]
    assert isinstance(q, qwix.QArray) and q.qvalue.dtype == jnp.int8, name
    assert q.qvalue.nbytes + q.scale.nbytes < 0.3 * w.nbytes, name
  assert rollout["lm_head"].qvalue.dtype == jnp.int8
  assert rollout["embed"] is not params["embed"] and rollout["embed"].dtype == params["embed"].dtype  # untied: float
  np.testing.assert_array_equal(rollout["layers"]["attn_norm"], params["layers"]["attn_norm"])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_rollout_logits_are_near_the_float_logits(tiny_config, tied):
  cfg = dataclasses.replace(tiny_config, tie_embeddings=tied)
  params = init_params(cfg, jax.random.key(1))
  tokens = _tokens(cfg)
  want = np.asarray(_forward(params, tokens, cfg))
  got = np.asarray(_forward(_rollout(params, cfg), tokens, cfg))
  err = np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2))
  # Rounding a weight to a step of its channel's max / 127 (about 2.5 sigma over these 40 to 96 inputs) errs by
  # step / sqrt(12) rms: 0.55% of the weight's scale, so each product's output is off by that much relative; ten
  # products in series (3 layers of q/k/v, o and the MLP's pair, and the output projection) give about 1.7% of the
  # logits in rms (seen 1.3% to 2.1% over 3 seeds). Skipping the quantisation gives 0, below the floor.
  assert 1e-3 < err < 0.05, err


def test_rollout_shardings_follow_the_weights(tiny_config):
  mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4, seq=1))  # embed over fsdp: contracted axes are split too
  cfg = dataclasses.replace(tiny_config, tie_embeddings=True)
  weights = param_shardings(cfg, mesh)
  shardings = rollout_shardings(cfg, mesh)
  params = jax.jit(init_params, static_argnums=0, out_shardings=weights)(cfg, jax.random.key(0))
  rollout = jax.jit(rollout_params, static_argnames="cfg", out_shardings=shardings)(params, cfg=cfg)
  for name in PROJECTIONS:
    spec = _padded(weights["layers"][name].spec, 4)
    q = rollout["layers"][name]
    assert _padded(q.qvalue.sharding.spec, 4) == spec, name
    # The scale keeps the output axes' split; its contracted axes (after `layers`) have size 1 and are replicated.
    contracted = range(1, 1 + lora.INPUT_AXES[name])
    assert _padded(q.scale.sharding.spec, 4) == tuple(None if a in contracted else p for a, p in enumerate(spec)), name
  assert rollout["embed"].qvalue.sharding.spec == weights["embed"].spec
  assert rollout["layers"]["q"].scale.sharding.spec[2] == "tensor"  # heads stay split
  assert rollout["layers"]["down"].scale.sharding.spec[2] == "fsdp"  # the output embed axis stays split


def _padded(spec, ndim):
  return tuple(spec) + (None,) * (ndim - len(spec))


def test_adapted_weights_are_refused_by_name(tiny_config):
  params = init_params(tiny_config, jax.random.key(0))
  cfg = LoRAConfig(rank=2, alpha=4.0, targets=("v",))
  adapted = lora.apply(params, lora.init_adapters(tiny_config, cfg, jax.random.key(1)), cfg)
  with pytest.raises(TypeError, match=r"params\['layers'\]\['v'\].*lora.merge"):
    rollout_params(adapted, tiny_config)
