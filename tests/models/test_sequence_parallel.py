"""Sequence parallelism through the model: ring attention in every layer, chunked loss, flat memory."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptx.algorithms import sft
from ptx.config import MeshConfig, OptimizerConfig
from ptx.model_config import ModelConfig
from ptx.models import init_params
from ptx.models.memory_floor import training_floor_bytes
from ptx.models.params import weight_decay_mask
from ptx.sharding import batch_sharding, make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.state import init_state, state_shardings
from ptx.train.step import make_train_step

MiB = 2**20


def _packed_batch(cfg, b, t, seed=0):
  """Rows of several documents (segment ids, restarting positions) and a loss mask."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, t), size=(b, 3), replace=False), axis=1)
  seg = (np.arange(t)[None, None] >= cuts[:, :, None]).sum(1).astype(np.int32) + 1
  starts = np.concatenate([np.zeros((b, 1), int), cuts], axis=1)
  pos = np.arange(t)[None] - np.take_along_axis(starts, seg - 1, axis=1)
  return {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32),
          "loss_mask": jnp.asarray(rng.random((b, t)) < 0.9, jnp.int32),
          "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos, jnp.int32)}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_cfg, b", [(MeshConfig(data=1, fsdp=1, tensor=1, seq=8), 1),
                                         (MeshConfig(data=4, fsdp=1, tensor=1, seq=2), 4)])
def test_ring_loss_and_gradients_at_16k_tokens_equal_unsharded(mesh_cfg, b):
  cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=96,
                    init_std=0.1, attention_impl="blockwise")
  ring = dataclasses.replace(cfg, attention_impl="ring", seq_layout="zigzag", remat="full", logits_chunk=256)
  params = init_params(cfg, jax.random.key(0))
  batch = _packed_batch(cfg, b, 16384 // b)
  grad = lambda c: jax.jit(jax.value_and_grad(functools.partial(sft.loss, model=c), has_aux=True))
  (want, _), want_grads = grad(cfg)(params, batch, None)
  mesh = make_mesh(mesh_cfg)
  with jax.set_mesh(mesh):
    sharded = jax.device_put(batch, batch_sharding(mesh))
    (got, _), got_grads = grad(ring)(params, sharded, None)
  # Ring attention, chunked logits and remat sum in other blocks and order: float32 rounding; the gradients sum over
  # 16k tokens, hence rtol 1e-4 (seen: 1% and 0.3% of these).
  np.testing.assert_allclose(got, want, rtol=1e-5)
  jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-6), got_grads, want_grads)


@pytest.mark.slow
def test_1m_token_training_step_memory_is_within_twice_the_floor():
  """A 1M-token step of a 2-layer d_model 256 model, ring-sharded over 8 devices (compile only)."""
  cfg = ModelConfig(vocab_size=32768, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=768,
                    attention_impl="ring", remat="full", logits_chunk=1024)
  t, n = 2**20, 8
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=n))
  optimizer = make_optimizer(OptimizerConfig(), 10, weight_decay_mask(cfg))
  shardings = state_shardings(cfg, optimizer, mesh)
  with jax.set_mesh(mesh):
    state = jax.eval_shape(lambda: init_state(cfg, optimizer, 0, mesh))
    state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), state, shardings)
    step = make_train_step(functools.partial(sft.loss, model=cfg), optimizer, mesh=mesh, state_shardings=shardings)
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=batch_sharding(mesh))
    compiled = step.lower(state, dict.fromkeys(("tokens", "loss_mask", "segment_ids", "positions"), ids)).compile()
  mem = compiled.memory_analysis()
  used = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
          + mem.temp_size_in_bytes)
  floor = training_floor_bytes(cfg, batch=1, seq_len=t, seq_shards=n)
  # Floor 2458 MiB (state 280, checkpoints 256, one layer 1410, KV blocks 256, logits 256); measured ~4.3 GiB.
  assert floor["total"] < used < 2 * floor["total"], f"{used / MiB:.0f} MiB vs floor {floor['total'] / MiB:.0f} MiB"
