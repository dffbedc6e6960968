"""Speculative decoding: greedy output == `generate`, sampled output == the standard engine's and follows the policy's
distribution (chi-square), acceptance counts exact on a constructed case, drafting off when it does not pay."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from test_engine import ENGINE_VS_TRAINER_ATOL, PROMPTS, SMALL, TIGHT, _greedy_case, _run, check_on_demand_greedy
from test_generate import GREEDY, _params

from model_variants import gemma_like
from ptx.config import ModelConfig
from ptx.models.decoder import forward, tempered
from ptx.models.params import param_shardings
from ptx.sampling import SamplingConfig, generate
from ptx.sampling.engine.drafters import NgramDrafter
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.acceptance import accepted_drafts
from ptx.sampling.engine.speculative import SpeculativeConfig, SpeculativeEngine

forward_jit = jax.jit(forward, static_argnames=("cfg",))
# Drafting always pays: every step with a draft verifies, so the tests exercise the verify path.
ALWAYS = SpeculativeConfig(drafts=4, verify_cost=1.0)
# The chi-square tests' significance level: a correct sampler fails one with probability 1e-3 (the seed is fixed,
# so the outcome is too). Wrong rules fail it: accepting every draft unchecked with p < 1e-190, keeping matching
# drafts past the first rejection with p < 1e-6 (measured with each patched into the verify program).
ALPHA = 1e-3


class _Scripted:
  """Proposes a known continuation of `prompt`, wrong at the generated indices in `wrong`."""

  def __init__(self, prompt, continuation, wrong, vocab):
    self.prompt, self.continuation, self.wrong, self.vocab = prompt, continuation, wrong, vocab

  def propose(self, context, k):
    n = len(context) - len(self.prompt)  # tokens generated so far (the pending one included)
    return [(t + 1) % self.vocab if i in self.wrong else t
            for i, t in enumerate(self.continuation[n:n + k], start=n)]


def _speculative(cfg, **kwargs):
  return SpeculativeEngine(cfg, SMALL, drafter=NgramDrafter(), speculative=ALWAYS, **kwargs)


def test_greedy_ngram_equals_generate_with_stops_and_budgets(tiny_config):
  cfg, params, stops, expected = _greedy_case(tiny_config)
  got = _run(_speculative(cfg, sampling=GREEDY), params, range(len(PROMPTS)), stops)
  for row, (tokens, finish) in enumerate(expected):
    (completion,) = got[row]
    np.testing.assert_array_equal(completion.tokens, tokens, err_msg=f"request {row}")
    assert completion.finish_reason == finish, row
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
  cfg, params, stops, expected = _greedy_case(gemma_like(tiny_config))
  placed = jax.device_put(params, param_shardings(cfg, mesh))
  rows = (3, 4, 6, 7)  # 3 and 7 stop at their 3rd token; 4 and 6 repeat themselves, so drafts are accepted
  got = _run(_speculative(cfg, sampling=GREEDY, mesh=mesh), placed, rows, stops, samples=2)
  for row in rows:
    tokens, finish = expected[row]
    for completion in got[row]:
      np.testing.assert_array_equal(completion.tokens, tokens, err_msg=f"request {row}")
      assert completion.finish_reason == finish
  assert sum(c.accepted for row in got for c in got[row]) > 0


def test_sampled_tokens_and_log_probs_equal_the_standard_engine(tiny_config):
  """The same seed gives the same tokens (one uniform per token, drafted or not) and the policy's tempered log-probs."""
  cfg = tiny_config
  params = _params(cfg)
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


# A vocabulary of 5 and 3 sampled tokens: 125 cells, whose exact probabilities one forward gives.
CHI_CFG = ModelConfig(vocab_size=5, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=24,
                      rope_theta=10_000.0, init_std=0.2)
# The drafter proposes 1, 3 from the first step on, and the policy samples 1 first with probability 0.31.
CHI_PROMPT = [1, 3] * 4
CHI_NEW, CHI_SAMPLES = 3, 4096


def _exact_joint(params, temperature):
  """The policy's probability of each continuation of CHI_PROMPT by CHI_NEW tokens, in itertools.product order."""
  V, P = CHI_CFG.vocab_size, len(CHI_PROMPT)
  tails = np.asarray(list(itertools.product(range(V), repeat=CHI_NEW)), np.int32)
  tokens = jnp.asarray(np.concatenate([np.tile(CHI_PROMPT, (len(tails), 1)), tails], axis=1))
  # float32 softmax: the sampler's own precision.
  logp = jax.nn.log_softmax(tempered(forward_jit(params, tokens, CHI_CFG), temperature), axis=-1)
  steps = [logp[:, P - 1 + j][np.arange(len(tails)), tails[:, j]] for j in range(CHI_NEW)]
  return np.exp(np.asarray(sum(steps))), tails


def _chi_square_p(counts, probs):
  """The p-value of observed counts against probabilities, cells expecting fewer than 5 merged into one."""
  expected = probs * counts.sum()
  small = expected < 5
  observed, expected = counts[~small], expected[~small]
  if small.any():
    observed = np.append(observed, counts[small].sum())
    expected = np.append(expected, probs[small].sum() * counts.sum())
  return stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


@pytest.fixture(scope="module")
def chi_samples():
  """Speculative samples of CHI_PROMPT at temperatures 1.0 and 0.8: {temperature: (counts per cell, accepted)}."""
  params = _params(CHI_CFG, seed=2)
  config = EngineConfig(max_seqs=64, pages=200, page_size=4, max_seq_len=16, decode_steps=3, prefill_chunk=8,
                        prefill_rows=1)
  out = {}
  for temperature in (1.0, 0.8):
    engine = SpeculativeEngine(CHI_CFG, config, drafter=NgramDrafter(), speculative=ALWAYS,
                               sampling=SamplingConfig(temperature=temperature), seed=11)
    for _ in range(CHI_SAMPLES // 64):  # groups that fill the slots: the calls keep few shapes (compilations)
      engine.submit(CHI_PROMPT, max_new_tokens=CHI_NEW, samples=64)
    done = engine.run(params)
    index = {tuple(t): i for i, t in enumerate(_exact_joint(params, temperature)[1].tolist())}
    counts = np.bincount([index[tuple(c.tokens.tolist())] for c in done.values()], minlength=len(index))
    out[temperature] = counts, sum(c.accepted for c in done.values()), sum(c.drafted for c in done.values())
  return params, out


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_speculative_samples_follow_the_policy(chi_samples, temperature):
  params, samples = chi_samples
  counts, accepted, drafted = samples[temperature]
  assert min(accepted, drafted - accepted) > 500  # drafts were accepted and rejected many times
  assert _chi_square_p(counts, _exact_joint(params, temperature)[0]) > ALPHA


def test_the_chi_square_detects_a_wrong_distribution(chi_samples):
  """Power: samples at temperature 0.8 are told apart from the policy at 1.0 (and the converse)."""
  params, samples = chi_samples
  assert _chi_square_p(samples[0.8][0], _exact_joint(params, 1.0)[0]) < ALPHA
  assert _chi_square_p(samples[1.0][0], _exact_joint(params, 0.8)[0]) < ALPHA


def test_acceptance_counts_are_exact_on_a_scripted_drafter(tiny_config):
  """Drafts = the greedy continuation, wrong at generated indices 2 and 7: counts follow by hand."""
  cfg, prompt = tiny_config, PROMPTS[1]
  params = _params(cfg)
  greedy = np.asarray(generate(params, [prompt], cfg=cfg, max_new_tokens=12, sampling=GREEDY,
                               rng=jax.random.key(0)).tokens[0]).tolist()
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


@pytest.mark.parametrize("rounds", [1, 3])
def test_device_ngram_counts_equal_a_replay_of_its_rounds(tiny_config, rounds):
  """The device loop's tokens are greedy's and its counts those of the rule replayed, however rounds split calls."""
  cfg = tiny_config
  params = _params(cfg)
  prompt, n_new = (PROMPTS[1] * 4)[:18], 30
  greedy = np.asarray(generate(params, [prompt], cfg=cfg, max_new_tokens=n_new, sampling=GREEDY,
                               rng=jax.random.key(0)).tokens[0]).tolist()
  drafter = NgramDrafter(max_ngram=2)
  engine = SpeculativeEngine(cfg, SMALL, sampling=GREEDY, drafter=drafter,
                             speculative=SpeculativeConfig(drafts=3, verify_cost=1.0, rounds=rounds))
  engine.submit(prompt, max_new_tokens=n_new)
  (done,) = engine.run(params).values()
  assert done.tokens.tolist() == greedy
  drafted, accepted = _replayed_ngram_counts(prompt, greedy, drafter, 3)
  assert 0 < accepted < drafted  # the case has both accepted and rejected drafts
  assert (done.drafted, done.accepted) == (drafted, accepted)


def test_drafting_turns_off_when_it_does_not_pay(tiny_config):
  """A drafter always wrong gives 1 token per verify; at a verify cost of 1.5 steps it drafts min_verifies times."""
  cfg, prompt = tiny_config, PROMPTS[1]
  params = _params(cfg)
  greedy = np.asarray(generate(params, [prompt], cfg=cfg, max_new_tokens=12, sampling=GREEDY,
                               rng=jax.random.key(0)).tokens[0]).tolist()
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
