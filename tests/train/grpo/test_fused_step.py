"""GRPO's fused RL step: one executable per step, equal to the unfused computation (also under LoRA); refill."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_steps import MESH, MODEL, N_NEW, TOK, build, even_tokens
from ptx.algorithms import advantages as adv_lib
from ptx.algorithms import grpo
from ptx.config import GRPOConfig, LoRAConfig, MeshConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.models import forward
from ptx.models import lora as lora_lib
from ptx.models.chunked_logits import logit_stats
from ptx.models.shared_prefix import SHARED_PREFIX_MIN_SLOTS
from ptx.train.grpo.token_rewards import encode_targets, exact_match
from ptx.sampling.buckets import left_pad
from ptx.sampling.generation import generate_padded
from ptx.sampling.rules import SamplingConfig
from ptx.train.grpo.fused import sample_kept_groups
from ptx.train.grpo.update import rollout_batch
from ptx.train.step import accumulate_gradients, trainable_loss

# Rollouts at temperature 0.7 (and top-p): every log-prob of the loss is the tempered policy's, the sampler's too
# (logp_diff_max).
TEMPERED = SamplingConfig(temperature=0.7, top_p=0.95)


def _prompts(n, seed=0, columns=8):
  task = ArithmeticTask(seed, 2)
  rows = [task[i] for i in range(n)]
  tokens, lengths = left_pad([[TOK.bos_id] + TOK.encode(r["prompt"]) for r in rows], n, columns, TOK.pad_id)
  return {"prompts": tokens, "prompt_lengths": lengths,
          "task": {"targets": encode_targets(TOK, [r["answer"] for r in rows], 4)}}


def _unfused_update(state, batch_in, cfg, grpo_cfg, optimizer, lora=None):
  """The step as separate programs: sample; score on the host; reference log-probs by the plain forward, one update."""
  policy = lambda s: s.params if lora is None else lora_lib.apply(s.base, s.params, lora)
  reference = lambda s: s.ref_params if lora is None else s.base
  prompts, lengths = jnp.asarray(batch_in["prompts"]), jnp.asarray(batch_in["prompt_lengths"])
  G = grpo_cfg.group_size
  stops = jnp.full((prompts.shape[0], 1), TOK.eos_id, jnp.int32)

  @jax.jit
  def sample(state):
    sample_key, update_key = jax.random.split(jax.random.fold_in(state.rng, state.step))
    return generate_padded(policy(state), prompts, lengths, stops, sample_key, N_NEW, cfg=cfg,
                           sampling=grpo_cfg.sampling, budget=N_NEW, group_size=G, pad_id=TOK.pad_id,
                           tempered_log_probs=True), update_key

  @jax.jit
  def update(state, gen, rewards, update_key):
    batch = rollout_batch(prompts, lengths, gen, G)
    batch["old_logps"] = batch["sampler_logps"]
    logits = forward(reference(state), batch["tokens"], cfg, positions=batch["positions"],
                     segment_ids=batch["segment_ids"])
    scored = logit_stats(logits[:, :-1], batch["tokens"][:, 1:], grpo_cfg.sampling.temperature).log_probs
    batch["ref_logps"] = jnp.pad(scored, ((0, 0), (1, 0)))
    batch["advantages"] = adv_lib.advantages(rewards, G, "grpo")
    batch.update(grpo.aggregation_inputs(batch["loss_mask"], grpo_cfg))
    loss_fn = trainable_loss(functools.partial(grpo.loss, model=cfg, grpo=grpo_cfg), state.base, lora)
    grads, _ = accumulate_gradients(loss_fn, state.params, batch, jax.random.fold_in(update_key, 0), 1)
    updates, _ = optimizer.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates)

  gen, update_key = sample(state)
  tokens, gen_lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
  rewards = np.asarray([np.mean(tokens[r, :n] % 2 == 0) if n else 0.0 for r, n in enumerate(gen_lengths)])
  return rewards, jax.tree.map(np.asarray, update(state, gen, jnp.asarray(rewards, jnp.float32), update_key))


# The fused step and the unfused programs round differently (their sums run in another order; the shared prompt's
# two softmaxes merge through their log-sum-exps; tempered logits add a division). With Adam's default eps = 1e-8
# that put single weights up to 5.3e-6 apart (1 of 1,120 at 3.6e-6 once failed `make test` at atol 1e-6); with
# ADAM_EPS the parameters after one update differ by <= 3.2e-8 in every case here, and atol 1e-6 leaves 30x.
UPDATE_RTOL, UPDATE_ATOL = 1e-5, 1e-6


def _assert_params_close(got, want):
  """The parameters after the same update by two programs: within UPDATE_RTOL / UPDATE_ATOL."""
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=UPDATE_RTOL, atol=UPDATE_ATOL), got,
               want)


ONE_DEVICE = MeshConfig(data=1, fsdp=1, tensor=1, seq=1)
# Prompts padded to 10 columns are copied to each row of their group (10 + 6 columns are also the zig-zag layout's
# 2 x 4 chunks of the ring test below).
COPIED_COLUMNS = 10


def _equivalence_run(columns, sampling, mesh_cfg=MESH):
  """3 fused steps from a fresh state, the first also computed unfused; what the tests below compare."""
  grpo_cfg = GRPOConfig(group_size=4, beta=0.04, sampling=sampling)
  built = build(MODEL, grpo_cfg, even_tokens, mesh_cfg=mesh_cfg)
  batch_in = _prompts(4, columns=columns)
  rewards, want = _unfused_update(built.state, batch_in, MODEL, grpo_cfg, built.optimizer)
  state, metrics = built.step(built.state, batch_in)
  first = {"params": jax.tree.map(np.asarray, state.params), "metrics": jax.device_get(metrics)}
  for seed in (1, 2):
    state, _ = built.step(state, _prompts(4, seed, columns))
  return {"step": built.step, "rewards": rewards, "want": want, "first": first, "state": state}


@pytest.fixture(scope="module")
def one_device_run():
  """The copied-prompts run on one device: compared with the unfused programs, and with the ring test's mesh."""
  return _equivalence_run(COPIED_COLUMNS, SamplingConfig(), ONE_DEVICE)


# Copied prompts on one device; prompts of SHARED_PREFIX_MIN_SLOTS columns, where each group shares one copy of its
# prompt's K/V in the sampler and in the update's forward, with tempered rollouts, on the (data=2, fsdp=4) mesh.
# (The LoRA test below samples copied prompts tempered.)
@pytest.mark.parametrize("case", ["copied_prompts_on_one_device", "shared_prompts_tempered_rollouts"])
def test_fused_step_is_one_executable_and_equals_the_unfused_computation(request, case):
  run = (request.getfixturevalue("one_device_run") if case == "copied_prompts_on_one_device"
         else _equivalence_run(SHARED_PREFIX_MIN_SLOTS, TEMPERED))
  metrics = run["first"]["metrics"]
  # The same tokens scored in-graph (float32 mean) and on the host (float64): rounding of the last bit only.
  np.testing.assert_allclose(float(metrics["reward/mean"]), run["rewards"].mean(), rtol=1e-6)
  _assert_params_close(run["first"]["params"], run["want"])
  # The sampler's and the update's log-probs of the same tokens: two programs, ~1e-6 apart; 1e-4 catches a real gap.
  assert float(metrics["rollout/logp_diff_max"]) < 1e-4
  assert run["step"]._cache_size() == 1, "the fused step recompiled"
  assert int(run["state"].step) == 3


def test_lora_fused_step_trains_adapters_against_the_base_as_reference_and_samples_tempered():
  grpo_cfg = GRPOConfig(group_size=4, beta=0.5, sampling=TEMPERED)
  lora = LoRAConfig(rank=4, alpha=8.0)
  built = build(MODEL, grpo_cfg, even_tokens, lora=lora)
  step, base = built.step, jax.tree.map(np.asarray, built.state.base)
  state, metrics = step(built.state, _prompts(4))
  # Fresh adapters: policy == base up to rounding d ~ 1e-6 of the log-probs, whose KL terms are ~d^2 / 2 << 1e-7.
  np.testing.assert_allclose(float(metrics["actor/kl_loss"]), 0.0, atol=1e-7)
  # The second step samples from base + trained adapters; its reference log-probs are the base's.
  batch_in = _prompts(4, seed=1)
  rewards, want = _unfused_update(state, batch_in, MODEL, grpo_cfg, built.optimizer, lora)
  state, metrics = step(state, batch_in)
  # As in the test above: host vs in-graph reward means, the sampler's vs the update's log-probs, the parameters.
  np.testing.assert_allclose(float(metrics["reward/mean"]), rewards.mean(), rtol=1e-6)
  assert float(metrics["actor/kl_loss"]) > 0.0 and float(metrics["rollout/logp_diff_max"]) < 1e-4
  _assert_params_close(state.params, want)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.base), base)
  assert state.ref_params is None and set(state.params) == set(lora.targets)
  state, _ = step(state, _prompts(4, seed=2))
  assert step._cache_size() == 1, "the fused step recompiled"
  assert int(state.step) == 3


def _flagged(gen, task):
  """1 for the second sample of a prompt whose task flag is 1, else 0: flag-0 groups have zero variance."""
  return (jnp.arange(gen.lengths.shape[0]) % 2) * task["flag"]


def test_refill_keeps_groups_with_signal_in_order_and_never_crashes():
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", filter_groups="refill", max_refill_rounds=2)
  built = build(MODEL, grpo_cfg, _flagged)
  batch_in = _prompts(12)
  batch_in["task"] = {"flag": np.asarray([1, 0, 0, 1, 0, 1, 0, 0, 1, 1, 1, 1], np.float32)}
  rollouts, _, _, metrics = jax.jit(lambda p, b: sample_kept_groups(p, b, jax.random.key(0), built.spec, _flagged))(
      built.state.params, batch_in)
  # Kept: prompts 0 and 3 (round 0), 5 (round 1), 8 (round 2, the first of four); then the rounds stop.
  want = batch_in["prompts"][[0, 3, 5, 8]]
  np.testing.assert_array_equal(np.asarray(rollouts["tokens"])[::2, :want.shape[1]], want)
  np.testing.assert_array_equal(np.asarray(rollouts["keep"]), 1)
  # Counts, exact in float32; 7 / 12 to float32 rounding (approx's default rel 1e-6).
  assert {k: float(v) for k, v in metrics.items()} == pytest.approx({
      "filter_groups/evicted": 5.0, "filter_groups/pass_rate": 7 / 12, "filter_groups/rounds": 3.0,
      "filter_groups/unfilled": 0.0})
  batch_in["task"]["flag"][:] = 0  # nothing to keep: trains on nothing, logs it
  before = jax.tree.map(np.asarray, built.state.params)
  state, metrics = built.step(built.state, batch_in)
  assert float(metrics["filter_groups/unfilled"]) == 4.0 and float(metrics["filter_groups/pass_rate"]) == 0.0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)


def test_exact_match_reward():
  targets = encode_targets(TOK, ["12", "7"], 4)
  eos = TOK.eos_id
  t12 = TOK.encode("12")
  tokens = jnp.asarray([t12 + [eos, 0], t12 + [eos, 0], TOK.encode("7") + [5, eos, 0]])
  lengths = jnp.asarray([3, 3, 3])
  got = exact_match(tokens, lengths, jnp.asarray(np.stack([targets[0], targets[1], targets[1]])))
  np.testing.assert_array_equal(got, [1.0, 0.0, 0.0])


def _flagged_and_exact(gen, task):
  """Two components: `_flagged`, and the exact-match reward against the task's targets."""
  return {"flag": _flagged(gen, task), "exact": exact_match(gen.tokens, gen.lengths, task["targets"])}


def test_zero_variance_groups_are_masked_over_epochs_and_minibatches_and_the_reference_is_refreshed():
  # Weights in sorted-name order: the exact-match component is computed and logged, the flags alone decide signal.
  grpo_cfg = GRPOConfig(group_size=2, beta=0.04, filter_groups="mask", ref_sync_every=1, ref_sync_alpha=0.25,
                        epochs=2, minibatches=2, reward_weights=(0.0, 1.0))
  built = build(MODEL, grpo_cfg, _flagged_and_exact)
  batch_in = _prompts(4)
  batch_in["task"]["flag"] = np.asarray([1, 0, 0, 1], np.float32)
  reference = jax.tree.map(np.asarray, built.state.ref_params)
  state, metrics = built.step(built.state, batch_in)
  assert {"reward/mean", "reward/exact/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/entropy",
          "response_length/mean", "response_length/clip_ratio", "frac_reward_zero_std",
          "actor/grad_norm"} <= set(metrics)
  assert 0.0 <= float(metrics["reward/exact/mean"]) <= 1.0 and np.isfinite(float(metrics["loss"]))
  assert float(metrics["filter_groups/evicted"]) == 2.0 and float(metrics["filter_groups/pass_rate"]) == 0.5
  want = jax.tree.map(lambda p, r: 0.25 * np.asarray(p) + 0.75 * r, state.params, reference)
  # One float32 multiply-add per weight in-graph and in NumPy: a rounding or two (an FMA or not), ~1e-7 relative.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7), state.ref_params,
               want)


def test_fused_step_on_a_sequence_sharded_mesh_with_ring_attention_equals_one_device(one_device_run, capfd):
  ring = dataclasses.replace(MODEL, attention_impl="ring", seq_layout="zigzag")
  batch_in = _prompts(4, columns=COPIED_COLUMNS)
  # The one-device run's configuration, rollouts and first batch, on 2 data x 4 sequence shards.
  ring_mesh = MeshConfig(data=2, fsdp=1, tensor=1, seq=4)
  built = build(ring, GRPOConfig(group_size=4, beta=0.04), even_tokens, mesh_cfg=ring_mesh)
  capfd.readouterr()
  compiled = built.step.lower(built.state, batch_in).compile()
  new_state, metrics = compiled(built.state, batch_in)
  hlo = compiled.as_text()
  assert "collective-permute" in hlo  # the ring ran, in the sampler and the update
  # The only gathers are the seq-sharded KV cache's per-token partials (the decode kernel's own shard_map merge);
  # an activation gathered along the sequence (GSPMD resharding it) would carry another op name.
  gathers = [line for line in hlo.splitlines() if " all-gather(" in line or " all-gather-start(" in line]
  assert gathers and all("shard_map/all_gather" in line for line in gathers), "\n".join(gathers)
  assert "nvoluntary full rematerialization" not in capfd.readouterr().err
  # Same sampled tokens (same rewards), then sums over other shards and ring hops: float32 rounding, the parameters
  # 3e-8 apart after the update (ADAM_EPS bounds how far the optimizer magnifies it; see UPDATE_ATOL).
  want = one_device_run["first"]
  np.testing.assert_allclose(float(metrics["reward/mean"]), float(want["metrics"]["reward/mean"]), rtol=1e-6)
  _assert_params_close(new_state.params, want["params"])
