"""The draft-model drafter and the rejection rule: the rule draws from the policy (chi-square, and a wrong q is caught),
greedy output == `generate`, sampled output follows the policy's distribution, a draft model equal to the policy has
every draft accepted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_setup import (ALPHA, ALWAYS, CHI_CFG, CHI_ENGINE, GREEDY, PROMPTS, SMALL, check_greedy, chi_counts,
                          chi_square_p, exact_joint, greedy_case, perturbed_params, run_requests)

from ptx.sampling import SamplingConfig
from ptx.sampling.engine.drafters import DraftModel
from ptx.sampling.engine.acceptance import rejection_sample
from ptx.sampling.engine.speculative import SpeculativeConfig, SpeculativeEngine


def _rule_samples(p_TV, q_KV, claimed_q_KV, n, seed=0):
  """n rows of the rule with drafts drawn from q_KV and tested against claimed_q_KV: (tokens [n, K + 1], accepted)."""
  rng = np.random.default_rng(seed)
  K, V = q_KV.shape
  drafts = np.stack([rng.choice(V, n, p=q_KV[j]) for j in range(K)], axis=1)
  tokens, accepted = rejection_sample(
      jnp.broadcast_to(p_TV, (n, K + 1, V)), jnp.broadcast_to(claimed_q_KV, (n, K, V)), jnp.asarray(drafts, jnp.int32),
      jnp.full((n,), K, jnp.int32), jnp.asarray(rng.random((n, K)), jnp.float32),
      jnp.asarray(rng.random((n, K + 1)), jnp.float32))
  return np.asarray(tokens), np.asarray(accepted)


def test_the_rejection_rule_draws_from_the_policy_and_a_wrong_q_is_caught():
  """Token 1 follows p_0; given draft 1 accepted, token 2 follows p_1. A drafter that misstates q fails the test."""
  rng = np.random.default_rng(1)
  p_TV = rng.dirichlet(np.ones(6), 3).astype(np.float32)
  q_KV = rng.dirichlet(np.ones(6), 2).astype(np.float32)
  tokens, accepted = _rule_samples(p_TV, q_KV, q_KV, 200_000)
  assert 0.2 < accepted.mean() < 1.8  # drafts both accepted and rejected
  assert chi_square_p(np.bincount(tokens[:, 0], minlength=6), p_TV[0]) > ALPHA
  assert chi_square_p(np.bincount(tokens[accepted >= 1, 1], minlength=6), p_TV[1]) > ALPHA
  uniform = np.full_like(q_KV, 1 / 6)
  wrong, _ = _rule_samples(p_TV, q_KV, uniform, 200_000)
  assert chi_square_p(np.bincount(wrong[:, 0], minlength=6), p_TV[0]) < ALPHA


def test_the_rejection_rule_is_greedy_for_one_hot_distributions():
  p_TV = jax.nn.one_hot(jnp.asarray([[2, 4, 1]]), 5)
  drafts = jnp.asarray([[2, 3]])
  tokens, accepted = rejection_sample(p_TV, jax.nn.one_hot(drafts, 5), drafts, jnp.asarray([2]),
                                      jnp.asarray([[0.99, 0.99]]), jnp.asarray([[0.5, 0.5, 0.5]]))
  assert tokens[0, :2].tolist() == [2, 4] and accepted.tolist() == [1]  # 2 accepted, 3 rejected: the argmax 4


def test_greedy_draft_model_equals_generate_and_the_policy_drafting_itself_is_always_accepted(tiny_config):
  """The policy as its own draft model over the whole context drafts the greedy tokens: each draft is accepted."""
  cfg, params, stops, expected = greedy_case(tiny_config)
  engine = SpeculativeEngine(cfg, SMALL, sampling=GREEDY, drafter=DraftModel(params, cfg, window=SMALL.max_seq_len),
                             speculative=ALWAYS)
  rows = (3, 4, 6, 7)  # 3 and 7 stop at their 3rd token; 4 and 6 run to their budgets
  got = run_requests(engine, params, rows, stops)
  check_greedy(got, expected, rows)
  for row in rows:
    (completion,) = got[row]
    # Drafts past a stop id are not emitted, so only a row without stops counts all its drafts accepted.
    assert completion.drafted > 0 and (completion.accepted == completion.drafted or stops[row]), row


@pytest.mark.slow  # 4,096 samples through programs of their own (the draft loop); the n-gram tests cover temperature 1
def test_draft_model_samples_follow_the_policy(temperature=0.8):
  """Drafts from another random model of the vocabulary, over a window of 4 tokens, at temperature 0.8."""
  params = perturbed_params(CHI_CFG, seed=2)
  drafter = DraftModel(perturbed_params(CHI_CFG, seed=5), CHI_CFG, window=4)
  engine = SpeculativeEngine(CHI_CFG, CHI_ENGINE, drafter=drafter, speculative=ALWAYS,
                             sampling=SamplingConfig(temperature=temperature), seed=13)
  counts, accepted, drafted = chi_counts(engine, params, temperature)
  assert min(accepted, drafted - accepted) > 500  # drafts were accepted and rejected many times
  assert chi_square_p(counts, exact_joint(params, temperature)[0]) > ALPHA


def test_sampled_draft_model_tokens_do_not_depend_on_rounds_per_call(tiny_config):
  """The draft stream's uniforms are drawn by token index, so splitting the rounds into calls changes nothing."""
  cfg = tiny_config
  params = perturbed_params(cfg)
  drafter = DraftModel(perturbed_params(cfg, seed=3), cfg, window=8)
  got = []
  for rounds in (1, 3):
    engine = SpeculativeEngine(cfg, SMALL, drafter=drafter, sampling=SamplingConfig(temperature=0.7, top_k=3),
                               speculative=SpeculativeConfig(drafts=3, verify_cost=1.0, rounds=rounds), seed=5)
    for prompt in PROMPTS[:4]:
      engine.submit(prompt, max_new_tokens=14, samples=2)
    got.append(engine.run(params))
  assert sorted(got[0]) == sorted(got[1])
  for seq_id, c in got[0].items():
    np.testing.assert_array_equal(got[1][seq_id].tokens, c.tokens)
    assert (got[1][seq_id].drafted, got[1][seq_id].accepted) == (c.drafted, c.accepted)
  assert 0 < sum(c.accepted for c in got[0].values()) < sum(c.drafted for c in got[0].values())


def test_a_draft_model_must_share_the_vocabulary(tiny_config):
  with pytest.raises(ValueError, match=r"DraftModel.cfg.vocab_size \(5\) must be the policy's \(264\)"):
    SpeculativeEngine(tiny_config, SMALL, drafter=DraftModel({}, CHI_CFG))
  with pytest.raises(ValueError, match="DraftModel.window"):
    DraftModel({}, CHI_CFG, window=0)
