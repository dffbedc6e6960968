"""The jitted training step: sharded == single device, accumulation, overfitting."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

from tolerances import ADAM_EPS
from ptx.algorithms import sft
from ptx.config import MeshConfig, OptimizerConfig
from ptx.models.params import weight_decay_mask
from ptx.sharding import make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.state import init_state, initial_params, state_shardings
from ptx.train.step import make_train_step

MESHES = {
    "single": (MeshConfig(data=1, fsdp=1, tensor=1, seq=1), 1),
    "data2_tensor4": (MeshConfig(data=2, fsdp=1, tensor=4, seq=1), 8),
    "fsdp8": (MeshConfig(data=1, fsdp=8, tensor=1, seq=1), 8),
}


def _batch(cfg, batch=8, seq=24, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(seq // 2, seq + 1, batch)
  b = {
      "tokens": rng.integers(3, cfg.vocab_size, (batch, seq)).astype(np.int32),
      "loss_mask": (rng.random((batch, seq)) < 0.7).astype(np.int32),
      "segment_ids": (np.arange(seq)[None] < lengths[:, None]).astype(np.int32),
      "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
  }
  b["tokens"] = np.where(b["segment_ids"] > 0, b["tokens"], 0).astype(np.int32)
  return b


# The default optimizer serves the equivalence tests, which compare parameters after an update of two programs:
# Adam's eps keeps their gradients' last-bit differences from being amplified (tolerances.py).
EQUIVALENCE_OPTIM = OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.1, eps=ADAM_EPS)
# Single device vs sharded, whole batch vs micro-batches: the same float32 math with sums in another order (psums over
# the mesh, accumulation): ~1e-6 relative; atol covers entries that are cancellations of larger terms.
REORDER_RTOL, REORDER_ATOL = 1e-5, 1e-5


def _setup(cfg, mesh_name, *, grad_accum=1, optim=EQUIVALENCE_OPTIM):
  mesh_cfg, n = MESHES[mesh_name]
  mesh = make_mesh(mesh_cfg, jax.devices()[:n])
  optimizer = make_optimizer(optim, 100, weight_decay_mask(cfg))
  shardings = state_shardings(cfg, optimizer, mesh)
  state = init_state(cfg, optimizer, 0, mesh)
  loss_fn = functools.partial(sft.loss, model=cfg)
  step = make_train_step(loss_fn, optimizer, mesh=mesh, state_shardings=shardings, grad_accum=grad_accum)
  return mesh, state, shardings, step, loss_fn


@pytest.mark.parametrize("mesh_name", ["data2_tensor4", "fsdp8"])
def test_sharded_loss_gradients_and_update_equal_single_device(tiny_config, mesh_name):
  batch = _batch(tiny_config)
  results = {}
  for name in ("single", mesh_name):
    mesh, state, shardings, step, loss_fn = _setup(tiny_config, name)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True),
                      in_shardings=(shardings.params, None, None))
    with jax.set_mesh(mesh):
      (loss, _), grads = grad_fn(state.params, batch, state.rng)
    new_state, metrics = step(state, batch)
    results[name] = (loss, grads, new_state.params, metrics)
  (l1, g1, p1, m1), (l2, g2, p2, m2) = results["single"], results[mesh_name]
  np.testing.assert_allclose(l2, l1, rtol=REORDER_RTOL, atol=REORDER_ATOL)
  close = functools.partial(np.testing.assert_allclose, rtol=REORDER_RTOL, atol=REORDER_ATOL)
  jax.tree.map(lambda a, b: close(np.asarray(a), np.asarray(b)), g2, g1)
  jax.tree.map(lambda a, b: close(np.asarray(a), np.asarray(b)), p2, p1)
  close(m2["grad_norm"], m1["grad_norm"])


def test_sharded_parameters_are_really_sharded(tiny_config):
  _, state, *_ = _setup(tiny_config, "fsdp8")
  # embed [V, D] with D = 40 over fsdp 8: 5 columns per device.
  assert state.params["embed"].addressable_shards[0].data.shape == (264, 5)
  mu = optax.tree_utils.tree_get(state.opt_state, "mu")["embed"]
  assert mu.sharding == state.params["embed"].sharding


def test_gradient_accumulation_equals_the_whole_batch(tiny_config):
  batch = _batch(tiny_config, batch=8)
  outs = []
  for accum in (1, 4):
    _, state, _, step, _ = _setup(tiny_config, "data2_tensor4", grad_accum=accum)
    new_state, metrics = step(state, batch)
    outs.append((new_state.params, metrics))
  (p1, m1), (p4, m4) = outs
  for key in ("loss", "accuracy", "weight", "grad_norm"):
    np.testing.assert_allclose(m4[key], m1[key], rtol=REORDER_RTOL, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=REORDER_RTOL, atol=REORDER_ATOL), p4, p1)


def test_step_compiles_once_and_donates_the_state(tiny_config):
  _, state, _, step, _ = _setup(tiny_config, "data2_tensor4")
  old_embed = state.params["embed"]
  for seed in range(3):
    state, _ = step(state, _batch(tiny_config, seed=seed))
  assert step._cache_size() == 1
  assert old_embed.is_deleted(), "the state was not donated"
  assert int(state.step) == 3


def test_a_tiny_model_overfits_one_batch(tiny_config):
  cfg = dataclasses.replace(tiny_config, init_std=0.02)
  optim = OptimizerConfig(lr=1e-2, warmup_steps=5, weight_decay=0.0, min_lr_ratio=1.0)
  _, state, _, step, _ = _setup(cfg, "data2_tensor4", optim=optim)
  batch = _batch(cfg, seed=3)
  for _ in range(80):
    state, metrics = step(state, batch)
  assert float(metrics["loss"]) < 0.05, (
      f"loss {float(metrics['loss']):.4f} after 80 steps: the step no longer fits a single batch")


def test_a_state_refuses_parameters_of_another_model(tiny_config):
  """Weights of a deeper model under a shallower config would train every layer and export only the config's."""
  mesh = make_mesh(MESHES["single"][0], jax.devices()[:1])
  optimizer = make_optimizer(EQUIVALENCE_OPTIM, 100)
  n = tiny_config.n_layers
  deeper = initial_params(dataclasses.replace(tiny_config, n_layers=n + 1), 0)
  with pytest.raises(ValueError, match=rf"init_params\['layers'\]\['.*'\] has shape \({n + 1}, .*n_layers={n},"
                                       rf".* makes it \({n}, .*ptx.from_pretrained\(dir, cfg\)"):
    init_state(tiny_config, optimizer, 0, mesh, params=deeper)
  with pytest.raises(ValueError, match=r"not the model config's parameters: 0 not in the config .* 1 missing"):
    init_state(tiny_config, optimizer, 0, mesh, params={k: v for k, v in deeper.items() if k != "lm_head"})
  same = initial_params(tiny_config, 0)
  assert int(init_state(tiny_config, optimizer, 0, mesh, params=same).step) == 0
