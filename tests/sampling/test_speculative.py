"""Speculative decoding: greedy output == `generate`, sampled output == the standard engine's and follows the policy's
distribution (chi-square), acceptance counts exact on a constructed case, drafting off when it does not pay."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_setup import (ALPHA, ALWAYS, CHI_CFG, CHI_ENGINE, ENGINE_VS_TRAINER_ATOL, GREEDY, PROMPTS, SMALL, TIGHT,
                          check_greedy, check_on_demand_greedy, chi_counts, chi_square_p, exact_joint, greedy_case,
                          greedy_tokens, perturbed_params, run_requests)

from model_variants import gemma_like
from ptx.models.params import param_shardings
from ptx.sampling import SamplingConfig
from ptx.sampling.engine.drafters import NgramDrafter
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.acceptance import accepted_drafts
from ptx.sampling.engine.speculative import SpeculativeConfig, SpeculativeEngine


class _Scripted:
  """Proposes a known continuation of `prompt`, wrong at the generated indices in `wrong`."""

  def __init__(self, prompt, continuation, wrong, vocab):
    self.prompt, self.continuation, self.wrong, self.vocab = prompt, continuation, wrong, vocab

  def propose(self, context, k):
    n = len(context) - len(self.prompt)  # tokens generated so far (the pending one included)
    return [(t + 1) % self.vocab if i in self.wrong else t
            for i, t in enumerate(self.continuation[n:n + k], start=n)]


def _speculative(cfg, **kwargs):
  """An n-gram speculative engine on SMALL that verifies every draft."""
  return SpeculativeEngine(cfg, SMALL, drafter=NgramDrafter(), speculative=ALWAYS, **kwargs)


def test_greedy_ngram_equals_generate_with_stops_and_budgets(tiny_config):
  cfg, params, stops, expected = greedy_case(tiny_config)
  got = run_requests(_speculative(cfg, sampling=GREEDY), params, range(len(PROMPTS)), stops)
  assert all(len(completions) == 1 for completions in got.values())
  check_greedy(got, expected, range(len(PROMPTS)))
  drafted, accepted = (sum(getattr(got[row][0], name) for row in got) for name in ("drafted", "accepted"))
  assert 0 < accepted < drafted  # drafts were both accepted and rejected


def test_greedy_ngram_with_on_demand_admission_equals_generate(tiny_config):
  """Verify rounds write up to rounds x (drafts + 1) positions a call: on-demand pages cover them, preempting."""
  engine = SpeculativeEngine(tiny_config, TIGHT, drafter=NgramDrafter(), sampling=GREEDY,
                             speculative=dataclasses.replace(ALWAYS, rounds=2))
  done = check_on_demand_greedy(engine, tiny_config)
  assert sum(c.drafted for c in done.values()) > 0


def test_sharded_greedy_ngram_equals_generate(tiny_config, mesh):
  """data=2 x tensor=4: rows and pages over data, KV heads over tensor; groups of 2 samples share prompt pages."""
  cfg, params, stops, expected = greedy_case(gemma_like(tiny_config))
  placed = jax.device_put(params, param_shardings(cfg, mesh))
  rows = (3, 4, 6, 7)  # 3 and 7 stop at their 3rd token; 4 and 6 repeat themselves, so drafts are accepted
  got = run_requests(_speculative(cfg, sampling=GREEDY, mesh=mesh), placed, rows, stops, samples=2)
  check_greedy(got, expected, rows)
  assert sum(c.accepted for row in got for c in got[row]) > 0


def test_sampled_tokens_and_log_probs_equal_the_standard_engine(tiny_config):
  """The same seed gives the same tokens (one uniform per token, drafted or not) and the policy's tempered log-probs."""
  cfg = tiny_config
  params = perturbed_params(cfg)
  # Prompts that repeat themselves, so the n-gram drafter proposes from the first step on; a peaked policy (low
  # temperature, top-k), so that sampled tokens repeat too and some drafts are accepted.
  prompts = [(p * 3)[:24] for p in PROMPTS[:6]]
  args = dict(sampling=SamplingConfig(temperature=0.5, top_k=4), seed=4, tempered_log_probs=True)
  standard, speculative = RolloutEngine(cfg, SMALL, **args), _speculative(cfg, **args)
  for engine in (standard, speculative):
    for prompt in prompts:
      engine.submit(prompt, max_new_tokens=12, samples=2)
  want, got = standard.run(params), speculative.run(params)
  assert sorted(want) == sorted(got)
  for seq_id, c in want.items():
    np.testing.assert_array_equal(got[seq_id].tokens, c.tokens)
    # One forward over K + 1 tokens against K + 1 single-token steps: the same float32 math in another order.
    np.testing.assert_allclose(got[seq_id].log_probs, c.log_probs, atol=ENGINE_VS_TRAINER_ATOL, rtol=0)
  assert sum(c.accepted for c in got.values()) > 0


@pytest.fixture(scope="module")
def chi_samples():
  """Speculative samples of CHI_PROMPT at temperatures 1.0 and 0.8: {temperature: (counts per cell, accepted)}."""
  params = perturbed_params(CHI_CFG, seed=2)
  out = {}
  for temperature in (1.0, 0.8):
    engine = SpeculativeEngine(CHI_CFG, CHI_ENGINE, drafter=NgramDrafter(), speculative=ALWAYS,
                               sampling=SamplingConfig(temperature=temperature), seed=11)
    out[temperature] = chi_counts(engine, params, temperature)
  return params, out


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_speculative_samples_follow_the_policy(chi_samples, temperature):
  params, samples = chi_samples
  counts, accepted, drafted = samples[temperature]
  assert min(accepted, drafted - accepted) > 500  # drafts were accepted and rejected many times
  assert chi_square_p(counts, exact_joint(params, temperature)[0]) > ALPHA


def test_the_chi_square_detects_a_wrong_distribution(chi_samples):
  """Power: samples at temperature 0.8 are told apart from the policy at 1.0 (and the converse)."""
  params, samples = chi_samples
  assert chi_square_p(samples[0.8][0], exact_joint(params, 1.0)[0]) < ALPHA
  assert chi_square_p(samples[1.0][0], exact_joint(params, 0.8)[0]) < ALPHA


def test_acceptance_counts_are_exact_on_a_scripted_drafter(tiny_config):
  """Drafts = the greedy continuation, wrong at generated indices 2 and 7: counts follow by hand."""
  cfg, prompt = tiny_config, PROMPTS[1]
  params = perturbed_params(cfg)
  greedy = greedy_tokens(params, cfg, prompt, 12)
  engine = SpeculativeEngine(cfg, SMALL, sampling=GREEDY, speculative=ALWAYS,
                             drafter=_Scripted(prompt, greedy, {2, 7}, cfg.vocab_size))
  engine.submit(prompt, max_new_tokens=12)
  (done,) = engine.run(params).values()
  assert done.tokens.tolist() == greedy
  # Verify 1 drafts indices 0-3, index 2 is wrong: 2 accepted, 3 emitted. Verify 2 drafts 3-6, all right: 4
  # accepted, 5 emitted (index 7 is the policy's own). Verify 3 has 4 tokens left: drafts 8-10, all accepted.
  assert (done.drafted, done.accepted) == (4 + 4 + 3, 2 + 4 + 3)


def _replayed_ngram_counts(prompt, greedy, drafter, drafts):
  """(drafted, accepted) of greedy n-gram speculation over `greedy`, replayed on the host round by round.

  A verify round's counts do not depend on which device call it falls in, and with `verify_cost` 1 every step with
  room for a draft verifies; the last token (no room) is decoded.
  """
  context, emitted, drafted, accepted = list(prompt), 0, 0, 0
  while emitted < len(greedy) - 1:
    k = min(drafts, len(greedy) - emitted - 1)
    (proposal,) = _ngram(drafter, [context], [k], drafts)
    a = next((i for i, (d, g) in enumerate(zip(proposal, greedy[emitted:])) if d != g), len(proposal))
    context += greedy[emitted:emitted + a + 1]
    emitted, drafted, accepted = emitted + a + 1, drafted + len(proposal), accepted + a
  return drafted, accepted


@pytest.mark.parametrize("rounds", [2, 1])
def test_device_ngram_counts_equal_a_replay_of_its_rounds(tiny_config, rounds):
  """The device loop's tokens are greedy's and its counts those of the rule replayed, however rounds split calls."""
  cfg = tiny_config
  params = perturbed_params(cfg)
  prompt, n_new = (PROMPTS[1] * 4)[:18], 30
  greedy = greedy_tokens(params, cfg, prompt, n_new)
  drafter, speculative = NgramDrafter(), dataclasses.replace(ALWAYS, rounds=rounds)
  # TIGHT's pool holds the one request (48 positions in 12 pages, never preempted); at 2 rounds a call, these are
  # the programs of the on-demand test above.
  engine = SpeculativeEngine(cfg, TIGHT, sampling=GREEDY, drafter=drafter, speculative=speculative)
  engine.submit(prompt, max_new_tokens=n_new)
  (done,) = engine.run(params).values()
  assert done.tokens.tolist() == greedy and engine.preemptions == 0
  drafted, accepted = _replayed_ngram_counts(prompt, greedy, drafter, speculative.drafts)
  assert 0 < accepted < drafted  # the case has both accepted and rejected drafts
  assert (done.drafted, done.accepted) == (drafted, accepted)


def test_drafting_turns_off_when_it_does_not_pay(tiny_config):
  """A drafter always wrong gives 1 token per verify; at a verify cost of 1.5 steps it drafts min_verifies times."""
  cfg, prompt = tiny_config, PROMPTS[1]
  params = perturbed_params(cfg)
  greedy = greedy_tokens(params, cfg, prompt, 12)
  engine = SpeculativeEngine(cfg, SMALL, sampling=GREEDY, drafter=_Scripted(prompt, greedy, set(range(12)), 264),
                             speculative=SpeculativeConfig(drafts=4, verify_cost=1.5, min_verifies=2))
  engine.submit(prompt, max_new_tokens=12)
  (done,) = engine.run(params).values()
  assert done.tokens.tolist() == greedy
  assert (done.drafted, done.accepted) == (2 * 4, 0)


def test_accepted_drafts_counts_leading_matches_within_each_rows_drafts():
  tokens = jnp.asarray([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
  drafts = jnp.asarray([[5, 6, 9], [5, 6, 7], [4, 6, 7], [5, 6, 7]])
  n_drafts = jnp.asarray([3, 3, 3, 1])
  assert accepted_drafts(tokens, drafts, n_drafts).tolist() == [2, 3, 0, 1]


def _ngram(drafter, contexts, ks, K):
  """`drafter.lookup` over ragged host contexts (padded with junk past each length): a list of each row's drafts."""
  width = max(map(len, contexts)) + 3
  padded = np.full((len(contexts), width), 9, np.int32)  # 9 past the length must never match
  for row, c in enumerate(contexts):
    padded[row, :len(c)] = c
  drafts, counts = drafter.lookup(jnp.asarray(padded), jnp.asarray([len(c) for c in contexts]), jnp.asarray(ks), K)
  return [d[:n] for d, n in zip(np.asarray(drafts).tolist(), np.asarray(counts).tolist())]


def test_ngram_drafter_copies_what_followed_the_longest_repeated_suffix():
  context = [1, 2, 3, 9, 2, 3, 7, 1, 2, 3]
  assert _ngram(NgramDrafter(max_ngram=3), [context], [3], 3) == [[9, 2, 3]]  # [1, 2, 3] at 0
  assert _ngram(NgramDrafter(max_ngram=1), [context], [3], 3) == [[7, 1, 2]]  # the latest [3], at 5
  # Every row of one call by its own rule: no draft wanted, no match, the latest match that 3 tokens follow, the
  # only match (one token follows it), fewer wanted than K (the latest [2, 3], at 4), a context shorter than n.
  got = _ngram(NgramDrafter(max_ngram=2), [context, [4, 5, 6], [7] * 6, [4, 4, 4], context, [8]], [0, 2, 3, 4, 1, 2],
               4)
  assert got == [[], [], [7] * 3, [4], [7], []]
def test_bad_settings_name_the_field():
  with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
    NgramDrafter(min_ngram=3, max_ngram=2)
  with pytest.raises(ValueError, match="SpeculativeConfig.drafts"):
    SpeculativeConfig(drafts=0)
  with pytest.raises(ValueError, match="SpeculativeConfig.verify_cost"):
    dataclasses.replace(ALWAYS, verify_cost=0.5)
