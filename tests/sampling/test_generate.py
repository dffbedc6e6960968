"""Generation: greedy equals full-forward argmax, log-probs equal training's, sharding changes nothing."""

import dataclasses

import jax
import numpy as np
import pytest
from engine_setup import GREEDY, argmax_reference, forward_jit, perturbed_params, right_padded

from model_variants import gemma_like, moe_like
from ptx.model_config import MoeConfig
from ptx.models.decoder import token_log_probs
from ptx.models.params import param_shardings
from ptx.sampling import LENGTH, STOP, SamplingConfig, generate
from ptx.sampling import generation as generation_lib

PROMPTS = [[5, 17, 9], [200, 3, 3, 41, 7, 90, 11], [12], [64, 65]]
# Tokens are compared exactly across programs (the cached sampler vs the training forward, sharded vs one device):
# a choice moves only if two candidates lie within float32 rounding (~1e-6) of each other, which these fixed
# inputs do not produce. Log-probs get a tolerance: the sampler's cached decode sums attention and the vocab in
# another order than the training forward, a few ulps of log-probs near -12 (ulp 9.5e-7).
# Seen 2.9e-6 against the training forward: atol 3e-5 leaves 10x; sharded vs single device, 9.1e-7 against 1e-5.
SAMPLER_VS_TRAINER_ATOL = 3e-5


@pytest.mark.parametrize("variant", ["llama", "gemma_sliding_window", "moe_ragged", "moe_sigmoid_groups"])
def test_greedy_equals_full_forward_argmax(tiny_config, variant):
  sigmoid = MoeConfig(n_experts=8, experts_per_token=2, expert_mlp_dim=16, router="sigmoid", n_groups=4,
                      topk_groups=2, routed_scale=2.5)
  cfg = {"llama": tiny_config, "gemma_sliding_window": gemma_like(tiny_config),
         "moe_ragged": moe_like(tiny_config, impl="ragged"),
         "moe_sigmoid_groups": dataclasses.replace(tiny_config, moe=sigmoid)}[variant]
  params = perturbed_params(cfg)
  n_new = 9  # past the window of 3, so the cache's window mask matters
  out = generate(params, PROMPTS, cfg=cfg, max_new_tokens=n_new, sampling=GREEDY, rng=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.tokens), argmax_reference(params, cfg, PROMPTS, n_new))
  np.testing.assert_array_equal(np.asarray(out.lengths), n_new)
  np.testing.assert_array_equal(np.asarray(out.finish_reasons), LENGTH)


# The "truncated" case's call, which test_sharded_equals_single_device runs on a mesh too: groups of 2 whose rows
# each hold a copy of their prompt's K/V.
TRUNCATED = dict(max_new_tokens=12, sampling=SamplingConfig(temperature=0.7, top_k=20, top_p=0.9),
                 rng=jax.random.key(4), group_size=2, shared_prompts=False)


# "tempered": the log-probs of the policy at the sampling temperature, untruncated, as GRPO's loss takes them.
@pytest.mark.parametrize("sampling, group_size, tempered", [
    (SamplingConfig(), 1, False), (TRUNCATED["sampling"], 2, False), (SamplingConfig(), 3, False),
    (SamplingConfig(temperature=0.7, top_p=0.9), 3, True)],
                         ids=["plain", "truncated", "groups_share_their_prompt", "tempered"])
def test_log_probs_equal_training_forward(tiny_config, sampling, group_size, tempered):
  cfg = gemma_like(tiny_config)  # sliding windows of 3: the 12 new tokens run past them
  params = perturbed_params(cfg)
  n_new = 12
  # Groups of 3: one copy of each prompt's K/V that its 3 rows read.
  out = generate(params, PROMPTS, cfg=cfg, max_new_tokens=n_new, sampling=sampling, rng=jax.random.key(4),
                 group_size=group_size, shared_prompts=group_size > 2, tempered_log_probs=tempered)
  prompts = [p for p in PROMPTS for _ in range(group_size)]  # row b * G + g continues prompt b
  tokens, positions, segments = right_padded(prompts, np.asarray(out.tokens), max(map(len, prompts)) + n_new)
  logits = forward_jit(params, tokens, cfg, positions=positions, segment_ids=segments)
  logits = logits / sampling.temperature if tempered else logits
  logp = token_log_probs(logits[:, :-1], tokens[:, 1:])
  expected = np.stack([np.asarray(logp[row, len(p) - 1:len(p) - 1 + n_new]) for row, p in enumerate(prompts)])
  np.testing.assert_allclose(np.asarray(out.log_probs), expected, atol=SAMPLER_VS_TRAINER_ATOL, rtol=0)


def test_stop_ids_end_rows_and_groups_share_the_prompt(tiny_config):
  params = perturbed_params(tiny_config)
  # Budget 16: the program of test_greedy_equals_full_forward_argmax[llama].
  greedy = generate(params, PROMPTS, cfg=tiny_config, max_new_tokens=8, sampling=GREEDY, rng=jax.random.key(0),
                    budget=16)
  # Stop row 0 at its 3rd greedy token, row 1 at its 1st; the others never stop.
  stops = [[int(greedy.tokens[0, 2])], [int(greedy.tokens[1, 0]), 7], [-5], [-5]]
  stopped = generate(params, PROMPTS, cfg=tiny_config, max_new_tokens=8, sampling=GREEDY, rng=jax.random.key(0),
                     stop_ids=stops, group_size=3, pad_id=0)
  first_stop = [min([i for i, t in enumerate(greedy.tokens[r].tolist()) if t in stops[r]] + [99]) for r in range(4)]
  lengths = np.repeat([min(f + 1, 8) for f in first_stop], 3)
  np.testing.assert_array_equal(np.asarray(stopped.lengths), lengths)
  np.testing.assert_array_equal(np.asarray(stopped.finish_reasons), np.where(lengths < 8, STOP, LENGTH))
  for row in range(12):
    n = lengths[row]
    np.testing.assert_array_equal(np.asarray(stopped.tokens[row, :n]), np.asarray(greedy.tokens[row // 3, :n]))
    assert np.all(np.asarray(stopped.tokens[row, n:]) == 0) and np.all(np.asarray(stopped.log_probs[row, n:]) == 0)


def test_group_samples_differ_and_match_ungrouped_distribution(tiny_config):
  cfg = gemma_like(tiny_config)
  out = generate(perturbed_params(cfg), PROMPTS, cfg=cfg, **TRUNCATED)  # the program of the "truncated" case
  assert out.tokens.shape == (8, 12)
  for prompt in range(len(PROMPTS)):  # the 2 samples of each prompt differ
    assert len({tuple(r) for r in np.asarray(out.tokens[2 * prompt:2 * prompt + 2]).tolist()}) > 1, prompt


def test_sharded_equals_single_device(tiny_config, mesh):
  cfg = gemma_like(tiny_config)
  params = perturbed_params(cfg)
  kwargs = dict(cfg=cfg, **TRUNCATED)
  single = generate(params, PROMPTS, **kwargs)  # test_log_probs_equal_training_forward[truncated]'s program
  sharded = generate(jax.device_put(params, param_shardings(cfg, mesh)), PROMPTS, mesh=mesh, **kwargs)
  assert len(sharded.tokens.sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(single.tokens))
  np.testing.assert_allclose(np.asarray(sharded.log_probs), np.asarray(single.log_probs), atol=1e-5)


@pytest.mark.parametrize("group_size", [1, 2], ids=["rows", "groups_share_their_prompt"])
def test_int8_cache_stays_close(tiny_config, group_size):
  params = perturbed_params(tiny_config)
  out = generate(params, PROMPTS, cfg=tiny_config, max_new_tokens=10, rng=jax.random.key(3), kv_int8=True,
                 group_size=group_size, shared_prompts=group_size > 1)
  prompts = [p for p in PROMPTS for _ in range(group_size)]
  tokens, positions, segments = right_padded(prompts, np.asarray(out.tokens), max(map(len, prompts)) + 10)
  logp = token_log_probs(forward_jit(params, tokens, tiny_config, positions=positions, segment_ids=segments)[:, :-1],
                         tokens[:, 1:])
  expected = np.stack([np.asarray(logp[row, len(p) - 1:len(p) + 9]) for row, p in enumerate(prompts)])
  error = np.abs(np.asarray(out.log_probs) - expected)
  # int8 K/V rounds each entry by up to absmax / 254 (0.4%): a loose bound on what that does to the log-probs.
  assert error.max() < 0.05, error.max()
  assert error.max() > 0  # the cache really is quantized


def test_bucketed_shapes_share_a_program(tiny_config):
  params = perturbed_params(tiny_config)
  before = generation_lib._generate_jit._cache_size()
  for n_prompts, n_new in ((3, 5), (4, 7), (2, 8)):
    generate(params, [[1, 2, 3]] * n_prompts, cfg=tiny_config, max_new_tokens=n_new,
             rng=jax.random.key(0))
  assert generation_lib._generate_jit._cache_size() - before <= 2  # batch buckets 4 and 2, one budget bucket


def test_budget_shares_one_program_and_keeps_the_tokens(tiny_config):
  params = perturbed_params(tiny_config)
  # Budget 16: the program of test_greedy_equals_full_forward_argmax[llama].
  alone = generate(params, PROMPTS, cfg=tiny_config, max_new_tokens=5, sampling=GREEDY, rng=jax.random.key(0),
                   budget=16)
  before = generation_lib._generate_jit._cache_size()
  warm = generate(params, PROMPTS, cfg=tiny_config, max_new_tokens=1, sampling=GREEDY, rng=jax.random.key(0),
                  budget=40)
  after_warm = generation_lib._generate_jit._cache_size()
  long = generate(params, PROMPTS, cfg=tiny_config, max_new_tokens=33, sampling=GREEDY, rng=jax.random.key(0),
                  budget=40)
  assert after_warm - before == 1 and generation_lib._generate_jit._cache_size() == after_warm  # bucket 64 once
  assert warm.tokens.shape == (4, 1) and long.tokens.shape == (4, 33)
  # The same program shape decodes the same tokens (greedy, exact: see the module's note on comparisons).
  np.testing.assert_array_equal(np.asarray(long.tokens[:, :5]), np.asarray(alone.tokens))
  np.testing.assert_array_equal(np.asarray(warm.tokens), np.asarray(alone.tokens[:, :1]))
  with pytest.raises(ValueError, match="budget=4 is below max_new_tokens=5"):
    generate(params, PROMPTS, cfg=tiny_config, max_new_tokens=5, rng=jax.random.key(0), budget=4)
