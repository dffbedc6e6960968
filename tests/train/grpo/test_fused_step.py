"""GRPO's fused RL step: one executable per step, equal to the unfused computation (also under LoRA); refill."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tolerances import ADAM_EPS
from ptx.algorithms import advantages as adv_lib
from ptx.algorithms import grpo
from ptx.config import GRPOConfig, LoRAConfig, MeshConfig, OptimizerConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import forward
from ptx.models import lora as lora_lib
from ptx.models.chunked_logits import logit_stats
from ptx.models.shared_prefix import SHARED_PREFIX_MIN_SLOTS
from ptx.train.grpo.token_rewards import encode_targets, exact_match
from ptx.sampling.buckets import left_pad
from ptx.sampling.generation import generate_padded
from ptx.sampling.rules import SamplingConfig
from ptx.sharding import make_mesh, rules_of
from ptx.train.optimizer import make_optimizer
from ptx.train.grpo.fused import make_grpo_step, sample_kept_groups
from ptx.train.grpo.update import RLSpec, rollout_batch
from ptx.train.state import init_state, state_shardings
from ptx.train.step import accumulate_gradients, trainable_loss

TOK = ByteTokenizer()
N_NEW = 6


def _even_tokens(gen, task):
  """A dense toy reward: the fraction of generated tokens that are even."""
  live = jnp.arange(gen.tokens.shape[1])[None] < gen.lengths[:, None]
  return ((gen.tokens % 2 == 0) & live).sum(axis=1) / jnp.maximum(gen.lengths, 1)


def _prompts(n, seed=0, columns=8):
  task = ArithmeticTask(seed, 2)
  rows = [task[i] for i in range(n)]
  tokens, lengths = left_pad([[TOK.bos_id] + TOK.encode(r["prompt"]) for r in rows], n, columns, TOK.pad_id)
  return {"prompts": tokens, "prompt_lengths": lengths,
          "task": {"targets": encode_targets(TOK, [r["answer"] for r in rows], 4)}}


def _setup(cfg, grpo_cfg, reward_fn, lora=None, **kw):
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  # The fused and unfused updates are compared: Adam's eps keeps their rounding from being amplified (tolerances.py).
  optimizer = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0, eps=ADAM_EPS), 10)
  with_ref = grpo_cfg.beta > 0
  shardings = state_shardings(cfg, optimizer, mesh, with_reference=with_ref, lora=lora)
  state = init_state(cfg, optimizer, 0, mesh, with_reference=with_ref, lora=lora)
  spec = RLSpec(model=cfg, grpo=grpo_cfg, max_new_tokens=N_NEW, stop_ids=(TOK.eos_id,), pad_id=TOK.pad_id, lora=lora,
                **kw)
  step = make_grpo_step(spec, reward_fn, optimizer=optimizer, mesh=mesh, state_shardings=shardings)
  return mesh, optimizer, state, step


def _unfused_update(state, batch_in, cfg, grpo_cfg, optimizer, lora=None):
  """The step computed as separate programs: sample, score on the host, reference log-probs, one update."""
  policy = state.params if lora is None else lora_lib.apply(state.base, state.params, lora)
  reference = state.ref_params if lora is None else state.base
  prompts, lengths = batch_in["prompts"], batch_in["prompt_lengths"]
  G = grpo_cfg.group_size
  sample_key, update_key = jax.random.split(jax.random.fold_in(state.rng, state.step))
  stops = np.full((prompts.shape[0], 1), TOK.eos_id, np.int32)
  temperature = grpo_cfg.sampling.temperature
  gen = jax.jit(generate_padded, static_argnames=("cfg", "sampling", "budget", "group_size", "pad_id",
                                                  "tempered_log_probs"))(
      policy, prompts, lengths, stops, sample_key, N_NEW, cfg=cfg, sampling=grpo_cfg.sampling, budget=N_NEW,
      group_size=G, pad_id=TOK.pad_id, tempered_log_probs=True)
  tokens, gen_lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
  rewards = np.asarray([np.mean(tokens[r, :n] % 2 == 0) if n else 0.0 for r, n in enumerate(gen_lengths)])
  batch = jax.tree.map(np.asarray, rollout_batch(jnp.asarray(prompts), jnp.asarray(lengths), gen, G))
  batch["old_logps"] = batch["sampler_logps"]
  logits = jax.jit(lambda p: forward(
      p, batch["tokens"], cfg, positions=batch["positions"], segment_ids=batch["segment_ids"]))(reference)
  scored = logit_stats(logits[:, :-1], jnp.asarray(batch["tokens"][:, 1:]), temperature).log_probs
  batch["ref_logps"] = np.pad(np.asarray(scored), ((0, 0), (1, 0)))
  batch["advantages"] = np.asarray(adv_lib.advantages(jnp.asarray(rewards, jnp.float32), G, "grpo"))
  batch.update(jax.tree.map(np.asarray, grpo.aggregation_inputs(jnp.asarray(batch["loss_mask"]), grpo_cfg)))
  loss_fn = trainable_loss(functools.partial(grpo.loss, model=cfg, grpo=grpo_cfg), state.base, lora)
  grads, _ = jax.jit(accumulate_gradients, static_argnums=(0, 4))(loss_fn, state.params, batch,
                                                                  jax.random.fold_in(update_key, 0), 1)
  updates, _ = optimizer.update(grads, state.opt_state, state.params)
  return rewards, jax.tree.map(np.asarray, optax.apply_updates(state.params, updates))


# The fused step and the unfused programs round differently (their sums run in another order; the shared prompt's
# two softmaxes merge through their log-sum-exps; tempered logits add a division). With Adam's default eps = 1e-8
# that put single weights up to 5.3e-6 apart (1 of 1,120 at 3.6e-6 once failed `make test` at atol 1e-6); with
# ADAM_EPS the parameters after one update differ by <= 3.2e-8 in all three cases, and atol 1e-6 leaves 30x.
UPDATE_RTOL, UPDATE_ATOL = 1e-5, 1e-6


# Prompts padded to 8 columns are copied to each row of their group; to SHARED_PREFIX_MIN_SLOTS columns, each
# group shares one copy of its prompt's K/V, in the sampler and in the update's forward. Rollouts at temperature
# 0.7 (and top-p): every log-prob of the loss is the tempered policy's, the sampler's too (logp_diff_max).
@pytest.mark.parametrize("columns, sampling", [
    (8, SamplingConfig()), (SHARED_PREFIX_MIN_SLOTS, SamplingConfig()),
    (8, SamplingConfig(temperature=0.7, top_p=0.95))], ids=["copied_prompts", "shared_prompts", "tempered_rollouts"])
def test_fused_step_is_one_executable_and_equals_the_unfused_computation(tiny_config, columns, sampling):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=4, beta=0.04, sampling=sampling)
  mesh, optimizer, state, step = _setup(cfg, grpo_cfg, _even_tokens)
  batch_in = _prompts(4, columns=columns)
  rewards, want = _unfused_update(state, batch_in, cfg, grpo_cfg, optimizer)

  new_state, metrics = step(state, batch_in)
  # The same tokens scored in-graph (float32 mean) and on the host (float64): rounding of the last bit only.
  np.testing.assert_allclose(float(metrics["reward/mean"]), rewards.mean(), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=UPDATE_RTOL, atol=UPDATE_ATOL),
               new_state.params, want)
  # The sampler's and the update's log-probs of the same tokens: two programs, ~1e-6 apart; 1e-4 catches a real gap.
  assert float(metrics["rollout/logp_diff_max"]) < 1e-4
  for seed in (1, 2):
    new_state, metrics = step(new_state, _prompts(4, seed, columns))
  assert step._cache_size() == 1, "the fused step recompiled"
  assert int(new_state.step) == 3


def test_lora_fused_step_trains_adapters_against_the_base_as_reference(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=4, beta=0.5)
  lora = LoRAConfig(rank=4, alpha=8.0)
  _, optimizer, state, step = _setup(cfg, grpo_cfg, _even_tokens, lora=lora)
  base = jax.tree.map(np.asarray, state.base)
  state, metrics = step(state, _prompts(4))
  # Fresh adapters: policy == base up to rounding d ~ 1e-6 of the log-probs, whose KL terms are ~d^2 / 2 << 1e-7.
  np.testing.assert_allclose(float(metrics["actor/kl_loss"]), 0.0, atol=1e-7)
  # The second step samples from base + trained adapters; its reference log-probs are the base's.
  batch_in = _prompts(4, seed=1)
  _, want = _unfused_update(state, batch_in, cfg, grpo_cfg, optimizer, lora)
  state, metrics = step(state, batch_in)
  assert float(metrics["actor/kl_loss"]) > 0.0 and float(metrics["rollout/logp_diff_max"]) < 1e-4  # as above
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=UPDATE_RTOL, atol=UPDATE_ATOL),
               state.params, want)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.base), base)
  assert state.ref_params is None and set(state.params) == set(lora.targets)


def _flagged(gen, task):
  """1 for the second sample of a prompt whose task flag is 1, else 0: flag-0 groups have zero variance."""
  return (jnp.arange(gen.lengths.shape[0]) % 2) * task["flag"]


def test_refill_keeps_groups_with_signal_in_order_and_never_crashes(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", filter_groups="refill", max_refill_rounds=2)
  _, _, state, step = _setup(cfg, grpo_cfg, _flagged)
  batch_in = _prompts(12)
  batch_in["task"] = {"flag": np.asarray([1, 0, 0, 1, 0, 1, 0, 0, 1, 1, 1, 1], np.float32)}
  spec = RLSpec(model=cfg, grpo=grpo_cfg, max_new_tokens=N_NEW, stop_ids=(TOK.eos_id,),
                pad_id=TOK.pad_id)
  rollouts, _, _, metrics = jax.jit(lambda p, b: sample_kept_groups(p, b, jax.random.key(0), spec, _flagged))(
      state.params, batch_in)
  # Kept: prompts 0 and 3 (round 0), 5 (round 1), 8 (round 2, the first of four); then the rounds stop.
  want = batch_in["prompts"][[0, 3, 5, 8]]
  np.testing.assert_array_equal(np.asarray(rollouts["tokens"])[::2, :want.shape[1]], want)
  np.testing.assert_array_equal(np.asarray(rollouts["keep"]), 1)
  # Counts, exact in float32; 7 / 12 to float32 rounding (approx's default rel 1e-6).
  assert {k: float(v) for k, v in metrics.items()} == pytest.approx({
      "filter_groups/evicted": 5.0, "filter_groups/pass_rate": 7 / 12, "filter_groups/rounds": 3.0,
      "filter_groups/unfilled": 0.0})
  batch_in["task"]["flag"][:] = 0  # nothing to keep: trains on nothing, logs it
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = step(state, batch_in)
  assert float(metrics["filter_groups/unfilled"]) == 4.0 and float(metrics["filter_groups/pass_rate"]) == 0.0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)


def test_exact_match_reward_and_several_minibatches_and_epochs(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  reward = lambda gen, task: exact_match(gen.tokens, gen.lengths, task["targets"])
  _, _, state, step = _setup(cfg, GRPOConfig(group_size=2, beta=0.0, kl_placement="none", epochs=2, minibatches=2),
                             reward)
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


def test_zero_variance_groups_are_masked_and_the_reference_is_refreshed(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.04, filter_groups="mask", ref_sync_every=1, ref_sync_alpha=0.25)
  _, _, state, step = _setup(cfg, grpo_cfg, _flagged)
  batch_in = _prompts(4)
  batch_in["task"] = {"flag": np.asarray([1, 0, 0, 1], np.float32)}
  reference = jax.tree.map(np.asarray, state.ref_params)
  state, metrics = step(state, batch_in)
  assert float(metrics["filter_groups/evicted"]) == 2.0 and float(metrics["filter_groups/pass_rate"]) == 0.5
  want = jax.tree.map(lambda p, r: 0.25 * np.asarray(p) + 0.75 * r, state.params, reference)
  # One float32 multiply-add per weight in-graph and in NumPy: a rounding or two (an FMA or not), ~1e-7 relative.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7), state.ref_params,
               want)


def test_fused_step_on_a_sequence_sharded_mesh_with_ring_attention_equals_one_device(tiny_config, capfd):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  ring = dataclasses.replace(cfg, attention_impl="ring", seq_layout="zigzag")
  grpo_cfg = GRPOConfig(group_size=4, beta=0.04)
  optimizer = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0, eps=ADAM_EPS), 10)
  batch_in = _prompts(4, columns=10)  # 10 + 6 columns: the zig-zag layout's 2 x 4 chunks

  def one_step(model, mesh_cfg):
    mesh = make_mesh(mesh_cfg, jax.devices()[:mesh_cfg.data * mesh_cfg.seq])
    rules = rules_of(mesh_cfg)
    shardings = state_shardings(model, optimizer, mesh, rules, with_reference=True)
    state = init_state(model, optimizer, 0, mesh, rules, with_reference=True)
    spec = RLSpec(model=model, grpo=grpo_cfg, max_new_tokens=N_NEW, stop_ids=(TOK.eos_id,), pad_id=TOK.pad_id,
                  rules=rules)
    compiled = make_grpo_step(spec, _even_tokens, optimizer=optimizer, mesh=mesh,
                              state_shardings=shardings).lower(state, batch_in).compile()
    new_state, metrics = compiled(state, batch_in)
    return compiled.as_text(), jax.tree.map(np.asarray, new_state.params), metrics

  _, want, want_metrics = one_step(cfg, MeshConfig(data=1, fsdp=1, tensor=1, seq=1))
  capfd.readouterr()
  hlo, got, metrics = one_step(ring, MeshConfig(data=2, fsdp=1, tensor=1, seq=4))
  assert "collective-permute" in hlo  # the ring ran, in the sampler and the update
  # The only gathers are the seq-sharded KV cache's per-token partials (the decode kernel's own shard_map merge);
  # an activation gathered along the sequence (GSPMD resharding it) would carry another op name.
  gathers = [line for line in hlo.splitlines() if " all-gather(" in line or " all-gather-start(" in line]
  assert gathers and all("shard_map/all_gather" in line for line in gathers), "\n".join(gathers)
  assert "nvoluntary full rematerialization" not in capfd.readouterr().err
  # Same sampled tokens (same rewards), then sums over other shards and ring hops: float32 rounding, the parameters
  # 3e-8 apart after the update (ADAM_EPS bounds how far the optimizer magnifies it; see UPDATE_ATOL).
  np.testing.assert_allclose(float(metrics["reward/mean"]), float(want_metrics["reward/mean"]), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=UPDATE_RTOL, atol=UPDATE_ATOL), got, want)
