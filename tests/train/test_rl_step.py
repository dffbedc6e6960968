"""GRPO's fused RL step: one executable per step, equal to the unfused computation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ptx.algorithms import advantages as adv_lib
from ptx.algorithms import grpo
from ptx.config import GRPOConfig, MeshConfig, OptimizerConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import forward
from ptx.rl.token_rewards import encode_targets, exact_match
from ptx.sampling.buckets import left_pad
from ptx.sampling.generation import generate_padded
from ptx.sampling.rules import SamplingConfig
from ptx.sharding import make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.rl_step import make_grpo_step, rollout_batch
from ptx.train.state import init_state, state_shardings
from ptx.train.step import accumulate_gradients

TOK = ByteTokenizer()
N_NEW = 6


def _even_tokens(gen, task):
  """A dense toy reward: the fraction of generated tokens that are even."""
  live = jnp.arange(gen.tokens.shape[1])[None] < gen.lengths[:, None]
  return ((gen.tokens % 2 == 0) & live).sum(axis=1) / jnp.maximum(gen.lengths, 1)


def _prompts(n, seed=0):
  task = ArithmeticTask(seed, 2)
  rows = [task[i] for i in range(n)]
  tokens, lengths = left_pad([[TOK.bos_id] + TOK.encode(r["prompt"]) for r in rows], n, 8, TOK.pad_id)
  return {"prompts": tokens, "prompt_lengths": lengths,
          "task": {"targets": encode_targets(TOK, [r["answer"] for r in rows], 4)}}


def _setup(cfg, grpo_cfg, reward_fn, **kw):
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  optimizer = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0), 10)
  with_ref = grpo_cfg.beta > 0
  shardings = state_shardings(cfg, optimizer, mesh, with_reference=with_ref)
  state = init_state(cfg, optimizer, 0, mesh, with_reference=with_ref)
  step = make_grpo_step(model=cfg, cfg=grpo_cfg, optimizer=optimizer, mesh=mesh, state_shardings=shardings,
                        reward_fn=reward_fn, sampling=SamplingConfig(), max_new_tokens=N_NEW,
                        stop_ids=(TOK.eos_id,), pad_id=TOK.pad_id, **kw)
  return mesh, optimizer, state, step


def test_fused_step_is_one_executable_and_equals_the_unfused_computation(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=4, beta=0.04)
  mesh, optimizer, state, step = _setup(cfg, grpo_cfg, _even_tokens)
  batch_in = _prompts(4)
  prompts, lengths = batch_in["prompts"], batch_in["prompt_lengths"]

  # The unfused reference: sample, score on the host, then update, as separate programs.
  params, opt_state, ref = state.params, state.opt_state, state.ref_params
  sample_key, update_key = jax.random.split(jax.random.fold_in(state.rng, 0))
  stops = np.full((4, 1), TOK.eos_id, np.int32)
  gen = jax.jit(generate_padded, static_argnames=("cfg", "sampling", "budget", "group_size", "pad_id"))(
      params, prompts, lengths, stops, sample_key, N_NEW, cfg=cfg, sampling=SamplingConfig(), budget=N_NEW,
      group_size=4, pad_id=TOK.pad_id)
  tokens, gen_lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
  rewards = np.asarray([np.mean(tokens[r, :n] % 2 == 0) if n else 0.0 for r, n in enumerate(gen_lengths)])
  batch = jax.tree.map(np.asarray, rollout_batch(jnp.asarray(prompts), jnp.asarray(lengths), gen, 4))
  batch["old_logps"] = batch["sampler_logps"]
  logits = jax.jit(lambda p: forward(
      p, batch["tokens"], cfg, positions=batch["positions"], segment_ids=batch["segment_ids"]))(ref)
  batch["ref_logps"] = np.asarray(grpo.token_logps(logits, jnp.asarray(batch["tokens"])))
  batch["advantages"] = np.asarray(adv_lib.advantages(jnp.asarray(rewards, jnp.float32), 4, "grpo"))
  batch.update(jax.tree.map(np.asarray, grpo.aggregation_inputs(jnp.asarray(batch["loss_mask"]), grpo_cfg)))
  loss_fn = functools.partial(grpo.loss, model=cfg, grpo=grpo_cfg)
  grads, _ = jax.jit(accumulate_gradients, static_argnums=(0, 4))(loss_fn, params, batch,
                                                                  jax.random.fold_in(update_key, 0), 1)
  updates, _ = optimizer.update(grads, opt_state, params)
  want = optax.apply_updates(params, updates)
  want = jax.tree.map(np.asarray, want)

  new_state, metrics = step(state, batch_in)
  np.testing.assert_allclose(float(metrics["reward/mean"]), rewards.mean(), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6),
               new_state.params, want)
  assert float(metrics["rollout/logp_diff_max"]) < 1e-4
  for seed in (1, 2):
    new_state, metrics = step(new_state, _prompts(4, seed))
  assert step._cache_size() == 1, "the fused step recompiled"
  assert int(new_state.step) == 3


def test_exact_match_reward_and_several_minibatches_and_epochs(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  reward = lambda gen, task: exact_match(gen.tokens, gen.lengths, task["targets"])
  _, _, state, step = _setup(cfg, GRPOConfig(group_size=2, beta=0.0, kl_placement="none"), reward,
                             epochs=2, minibatches=2)
  state, metrics = step(state, _prompts(4))
  assert {"reward/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/entropy", "response_length/mean",
          "response_length/clip_ratio", "frac_reward_zero_std", "actor/grad_norm"} <= set(metrics)
  assert 0.0 <= float(metrics["reward/mean"]) <= 1.0 and np.isfinite(float(metrics["loss"]))


def test_exact_match_reward():
  targets = encode_targets(TOK, ["12", "7"], 4)
  eos = TOK.eos_id
  t12 = TOK.encode("12")
  tokens = jnp.asarray([t12 + [eos, 0], t12 + [eos, 0], TOK.encode("7") + [5, eos, 0]])
  lengths = jnp.asarray([3, 3, 3])
  got = exact_match(tokens, lengths, jnp.asarray(np.stack([targets[0], targets[1], targets[1]])))
  np.testing.assert_array_equal(got, [1.0, 0.0, 0.0])
