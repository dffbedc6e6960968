"""LoRA training: only adapters are optimised, the base is held once, the reference is the base.

A LoRA run from the command line, resumed from a checkpoint (which holds the adapters only), is
tests/test_cli_export.py's; tests/test_jobs_agree.py shows `--lora.rank` builds the same Job for sft and dpo.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tolerances import ADAM_EPS
from ptx.algorithms import dpo, grpo, sft
from ptx.config import DPOConfig, GRPOConfig, LoRAConfig, MeshConfig, OptimizerConfig
from ptx.models import lora as lora_lib
from ptx.models.chunked_logits import logit_stats
from ptx.models.decoder import forward
from ptx.sharding import make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.state import init_state, initial_params, state_shardings
from ptx.train.step import make_train_step, reference_params

LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.1)
OPTIM = OptimizerConfig(lr=1e-2, warmup_steps=0)
# The sharded SFT step of the first two tests: one program, compiled once. Adam's eps keeps the rounding of two programs
# (sharded vs single device) from being amplified in the second (tolerances.py).
SFT_OPTIM = dataclasses.replace(OPTIM, eps=ADAM_EPS)


def _rows(cfg, batch, seq, seed):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(seq // 2, seq + 1, batch)
  segment_ids = (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
  return {
      "tokens": np.where(segment_ids > 0, rng.integers(3, cfg.vocab_size, (batch, seq)), 0).astype(np.int32),
      "loss_mask": segment_ids.copy(),
      "segment_ids": segment_ids,
      "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
  }


def _bytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_only_adapters_are_optimised_and_the_base_is_held_once(tiny_config, mesh):
  optimizer = make_optimizer(SFT_OPTIM, 100)
  shardings = state_shardings(tiny_config, optimizer, mesh, lora=LORA, with_reference=True)
  state = init_state(tiny_config, optimizer, 0, mesh, lora=LORA, with_reference=True)
  assert state.ref_params is None  # the reference is the base: no second copy
  adapters = jax.tree.structure(state.params)
  assert adapters == jax.tree.structure(lora_lib.abstract_adapters(tiny_config, LORA))
  mu, nu = (optax.tree_utils.tree_get(state.opt_state, k) for k in ("mu", "nu"))
  assert jax.tree.structure(mu) == adapters and jax.tree.structure(nu) == adapters
  assert _bytes(state.opt_state) < 2 * _bytes(state.params) + 64 < _bytes(state.base) / 4
  base = jax.device_get(state.base)
  np.testing.assert_array_equal(base["embed"], np.asarray(initial_params(tiny_config, 0)["embed"]))
  pointer = state.base["layers"]["q"].addressable_shards[0].data.unsafe_buffer_pointer()

  step = make_train_step(functools.partial(sft.loss, model=tiny_config), optimizer, mesh=mesh,
                         state_shardings=shardings, lora=LORA)
  batch = _rows(tiny_config, 8, 16, seed=0)
  losses = []
  for _ in range(6):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0] - 0.1, losses
  # The donated base comes back in the same buffers, unchanged; B has moved off zero.
  assert state.base["layers"]["q"].addressable_shards[0].data.unsafe_buffer_pointer() == pointer
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.base), base)
  assert float(jnp.abs(state.params["v"]["b"]).max()) > 0
  assert state.params["q"]["b"].sharding == shardings.params["q"]["b"]


def test_sharded_lora_steps_equal_single_device(tiny_config, mesh):
  single = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=1), jax.devices()[:1])
  optimizer = make_optimizer(SFT_OPTIM, 100)
  batch = _rows(tiny_config, 8, 16, seed=5)
  results = []
  for m in (single, mesh):
    state = init_state(tiny_config, optimizer, 0, m, lora=LORA)
    step = make_train_step(functools.partial(sft.loss, model=tiny_config), optimizer, mesh=m,
                           state_shardings=state_shardings(tiny_config, optimizer, m, lora=LORA), lora=LORA)
    for _ in range(2):
      state, metrics = step(state, batch)
    results.append((jax.device_get(state.params), float(metrics["loss"])))
  (p1, l1), (p2, l2) = results
  # Sharded vs single device: the same float32 math with sums in another order (psums), ~1e-6 relative.
  np.testing.assert_allclose(l2, l1, rtol=1e-5)
  # The adapters move by up to lr = 1e-2 a step; atol 1e-5 is 0.1% of that, rtol 1e-4 ~100x float32 rounding.
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-5), p2, p1)


def test_dpo_reference_is_the_base_with_adapters_off(tiny_config, mesh):
  cfg = LoRAConfig(rank=4, alpha=8.0)
  dpo_cfg = DPOConfig(beta=0.5)
  optimizer = make_optimizer(OPTIM, 100)
  state = init_state(tiny_config, optimizer, 0, mesh, lora=cfg, with_reference=True)
  step = make_train_step(functools.partial(dpo.loss, model=tiny_config, dpo=dpo_cfg), optimizer, mesh=mesh,
                         state_shardings=state_shardings(tiny_config, optimizer, mesh, lora=cfg,
                                                         with_reference=True),
                         prepare=functools.partial(dpo.prepare, model=tiny_config), lora=cfg)
  batch = {"chosen": _rows(tiny_config, 8, 16, seed=1), "rejected": _rows(tiny_config, 8, 16, seed=2)}
  base = initial_params(tiny_config, 0)
  reference = dpo.prepare(base, batch, model=tiny_config)
  for i in range(4):
    adapters = jax.device_get(state.params)
    assert reference_params(state) is state.base
    # The step's loss is the policy (base + adapters) against the base's log-probs.
    expected, _ = dpo.loss(lora_lib.apply(base, adapters, cfg), reference, None, model=tiny_config, dpo=dpo_cfg)
    state, metrics = step(state, batch)
    # The sharded step vs the same loss run eagerly on one device: reordered float32 sums, ~1e-6 relative.
    np.testing.assert_allclose(float(metrics["loss"]), float(expected), rtol=1e-5, atol=1e-6)
    if i == 0:
      # Fresh adapters (B = 0) add exact zeros: the policy is the reference (bit-equal here). If the two forwards
      # ever round apart, sequence log-probs near -70 (ulp 7.6e-6) times beta 0.5 move the margin by ~4e-6 an ulp.
      np.testing.assert_allclose(float(metrics["rewards/margins"]), 0.0, atol=2e-5)
  assert float(metrics["rewards/margins"]) > 0.05


def _grpo_reference(ref_params, batch, *, model):
  """GRPO's batch preparation: reference log-probs of the batch's tokens."""
  logits = forward(ref_params, batch["tokens"], model, positions=batch["positions"],
                   segment_ids=batch["segment_ids"])
  scored = logit_stats(logits[:, :-1], batch["tokens"][:, 1:]).log_probs
  return {**batch, "ref_logps": jnp.pad(scored, ((0, 0), (1, 0)))}


def _grpo_loss(params, batch, rng, **kwargs):
  """grpo.loss on a batch whose per-row values come as [B, T] columns, as make_train_step shards inputs."""
  rows = {k: batch[k][:, 0] for k in ("advantages", "agg_total")}
  return grpo.loss(params, {**batch, **rows}, rng, **kwargs)


def test_grpo_reference_is_the_base_with_adapters_off(tiny_config, mesh):
  cfg = LoRAConfig(rank=4, alpha=8.0)
  grpo_cfg = GRPOConfig(group_size=4, beta=0.5)
  optimizer = make_optimizer(OPTIM, 100)
  state = init_state(tiny_config, optimizer, 0, mesh, lora=cfg, with_reference=True)
  step = make_train_step(functools.partial(_grpo_loss, model=tiny_config, grpo=grpo_cfg), optimizer, mesh=mesh,
                         state_shardings=state_shardings(tiny_config, optimizer, mesh, lora=cfg,
                                                         with_reference=True),
                         prepare=functools.partial(_grpo_reference, model=tiny_config), lora=cfg)
  base = initial_params(tiny_config, 0)
  batch = _rows(tiny_config, 8, 16, seed=3)
  batch = _grpo_reference(base, batch, model=tiny_config)
  batch = {**batch, "old_logps": batch.pop("ref_logps"), **grpo.aggregation_inputs(batch["loss_mask"], grpo_cfg),
           "advantages": jnp.asarray(np.random.default_rng(4).normal(size=8), jnp.float32)}
  batch.update({k: jnp.tile(batch[k][:, None], (1, 16)) for k in ("advantages", "agg_total")})
  reference = _grpo_reference(base, batch, model=tiny_config)
  for i in range(3):
    adapters = jax.device_get(state.params)
    expected, _ = _grpo_loss(lora_lib.apply(base, adapters, cfg), reference, None, model=tiny_config, grpo=grpo_cfg)
    state, metrics = step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected), rtol=1e-5, atol=1e-6)  # as in the DPO test
    if i == 0:  # fresh adapters: the policy is the reference; k3's KL of rounding d ~ 1e-6 is ~d^2 / 2 << 1e-7
      np.testing.assert_allclose(float(metrics["actor/kl_loss"]), 0.0, atol=1e-7)
  assert float(metrics["actor/kl_loss"]) > 1e-6
