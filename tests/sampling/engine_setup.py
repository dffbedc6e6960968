"""What the sampler and engine tests share: perturbed parameters, the requests and shapes the engine tests drive,
`generate`'s greedy references in one compiled program per model, and the chi-square check of sampled tokens."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from ptx.model_config import ModelConfig
from ptx.models import init_params
from ptx.models.decoder import forward, tempered
from ptx.sampling import LENGTH, STOP, SamplingConfig, generate
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.speculative import SpeculativeConfig

forward_jit = jax.jit(forward, static_argnames=("cfg",))
GREEDY = SamplingConfig(greedy=True)


@functools.cache  # one tree per config and seed in a process: every test only reads it
def perturbed_params(cfg, seed=0):
  """`init_params` with every leaf moved by 0.1 standard normals, so that the zero-initialised (1 + w) norms matter."""
  params = init_params(cfg, jax.random.key(seed))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def right_padded(prompts, completions, width):
  """Prompt + completion rows, right-padded with a padding segment, for the training forward."""
  tokens = np.zeros((len(prompts), width), np.int32)
  segments = np.zeros((len(prompts), width), np.int32)
  for row, (p, c) in enumerate(zip(prompts, completions)):
    seq = list(p) + list(c)
    tokens[row, :len(seq)], segments[row, :len(seq)] = seq, 1
  positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
  return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)


def argmax_reference(params, cfg, prompts, n_new):
  """Step-by-step argmax of the training forward over the growing sequences."""
  width = max(map(len, prompts)) + n_new
  seqs = [list(p) for p in prompts]
  for _ in range(n_new):
    tokens, positions, segments = right_padded(seqs, [[]] * len(seqs), width)
    logits = forward_jit(params, tokens, cfg, positions=positions, segment_ids=segments)
    for row, seq in enumerate(seqs):
      seq.append(int(jnp.argmax(logits[row, len(seq) - 1])))
  return np.asarray([s[len(p):] for s, p in zip(seqs, prompts)])


# The greedy `generate` references of the engine tests all run one program per model: the prompts are joined by
# filler rows up to REFERENCE_ROWS, one filler long enough for the 64-token prompt bucket, under the budget bucket
# REFERENCE_BUDGET with 2 stop ids a row. `generate`'s rows are independent, so a filler changes no real row.
REFERENCE_ROWS, REFERENCE_BUDGET, REFERENCE_STOPS = 16, 32, 2
_FILLER = list(range(1, 41))  # 40 tokens: bucket 64, as the engine tests' longest prompts (40 and 45 tokens)


def greedy_reference(params, cfg, prompts, max_new_tokens, stop_ids=None):
  """`generate`'s greedy Generation of `prompts` (each with its own `stop_ids`), in the engine tests' shared program."""
  assert len(prompts) < REFERENCE_ROWS and max_new_tokens <= REFERENCE_BUDGET, (len(prompts), max_new_tokens)
  stop_ids = [list(s) for s in stop_ids or [[]] * len(prompts)]
  assert max(map(len, stop_ids)) <= REFERENCE_STOPS, stop_ids
  fillers = REFERENCE_ROWS - len(prompts)
  # -1 is no token: it pads each row's stop ids to the shared width.
  stops = [s + [-1] * (REFERENCE_STOPS - len(s)) for s in stop_ids + [[]] * fillers]
  out = generate(params, list(prompts) + [_FILLER] * fillers, cfg=cfg, max_new_tokens=max_new_tokens,
                 sampling=GREEDY, rng=jax.random.key(0), stop_ids=stops, budget=REFERENCE_BUDGET)
  return jax.tree.map(lambda x: x[:len(prompts)], out)


def greedy_tokens(params, cfg, prompt, max_new_tokens):
  """`greedy_reference`'s tokens for one prompt, as a list."""
  return np.asarray(greedy_reference(params, cfg, [prompt], max_new_tokens).tokens[0]).tolist()


# The engine tests' requests: prompt lengths from 1 (nothing to prefill: the first decode step feeds the prompt's only
# token) past two chunks, and a budget each.
_RNG = np.random.default_rng(7)
PROMPTS = [_RNG.integers(1, 264, n).tolist() for n in (1, 5, 17, 3, 40, 9, 2, 26, 12, 8)]
BUDGETS = [6, 14, 3, 14, 9, 1, 12, 14, 5, 10]
N_NEW = max(BUDGETS)
# Small shapes so that requests queue behind the slots, prompts take several prefill chunks and pages, and a
# decode call stops part-way through most budgets.
SMALL = EngineConfig(max_seqs=4, pages=64, page_size=4, max_seq_len=64, decode_steps=5, prefill_chunk=16,
                     prefill_rows=2)
# The sampling rules of the sampled tests (one compiled decode program for all of them): truncated and tempered.
SAMPLED = SamplingConfig(temperature=0.7, top_p=0.9)
# Log-probs of the engine and of the training forward: the same float32 math summed in another order (attention
# over gathered pages in one block vs the training kernel), a few ulps of log-probs near -6; seen below 2e-6.
ENGINE_VS_TRAINER_ATOL = 1e-5


def _expected(reference, stops):
  """Per request: `generate`'s greedy tokens cut at the request's budget, and the finish reason that gives."""
  out = []
  for row, budget in enumerate(BUDGETS):
    tokens = np.asarray(reference.tokens[row, :int(reference.lengths[row])])[:budget]
    stopped = tokens.size > 0 and int(tokens[-1]) in stops[row]
    out.append((tokens, STOP if stopped else LENGTH))
  return out


@functools.cache  # one reference per config: the greedy and sharded tests of a config share it (read only)
def greedy_case(cfg):
  """(cfg, params, stop ids per request, [(tokens, finish reason)] per request) of `generate` over PROMPTS."""
  params = perturbed_params(cfg)
  plain = greedy_reference(params, cfg, PROMPTS, N_NEW)
  # Stop ids for half the requests: their 3rd greedy token (so they stop early), and one never sampled.
  stops = [[int(plain.tokens[row, 2]), 263] if row % 2 else [] for row in range(len(PROMPTS))]
  return cfg, params, stops, _expected(greedy_reference(params, cfg, PROMPTS, N_NEW, stops), stops)


def run_requests(engine, params, order, stops, samples=1):
  """Submits PROMPTS[row] for each row in `order`; returns {row: [completion of each sample]}."""
  ids = {row: engine.submit(PROMPTS[row], max_new_tokens=BUDGETS[row], stop_ids=stops[row], samples=samples)
         for row in order}
  done = engine.run(params)
  assert engine.allocator.in_use == 0  # every page came back
  return {row: [done[i] for i in seq_ids] for row, seq_ids in ids.items()}


def check_greedy(got, expected, rows):
  """Every completion of each request in `rows` has `generate`'s tokens and finish reason."""
  for row in rows:
    tokens, finish = expected[row]
    for completion in got[row]:
      np.testing.assert_array_equal(completion.tokens, tokens, err_msg=f"request {row}")
      assert completion.finish_reason == finish, row


def grouped_equals_copied(cfg, config, params, G):
  """A group of G samples of PROMPTS[4] (shared prompt pages) == G copies of it submitted apart; their engines."""
  grouped = RolloutEngine(cfg, config, sampling=SAMPLED, seed=2)
  grouped.submit(PROMPTS[4], max_new_tokens=8, samples=G)
  copied = RolloutEngine(cfg, config, sampling=SAMPLED, seed=2)
  for _ in range(G):
    copied.submit(PROMPTS[4], max_new_tokens=8)
  a, b = grouped.run(params), copied.run(params)
  assert sorted(a) == sorted(b) == list(range(G))
  for i in range(G):
    np.testing.assert_array_equal(a[i].tokens, b[i].tokens)
    np.testing.assert_allclose(a[i].log_probs, b[i].log_probs, atol=1e-6, rtol=0)  # the same programs' floats
  assert len({tuple(a[i].tokens) for i in range(G)}) > 1  # the samples differ
  return grouped, copied


# "on_demand" admission: short prompts with long budgets in a pool of 20 pages, where 4 sequences at 32 new tokens
# need 36 to 40. Rows outgrow the pool call after call, so the last submitted are preempted and prefilled again;
# one compiled set of programs serves every test of it.
TIGHT = dataclasses.replace(SMALL, pages=21, admission="on_demand")
SHORT = [prompt[:9] for prompt in PROMPTS]
LONG_BUDGET = 32


def check_on_demand_greedy(engine, cfg):
  """Runs SHORT through `engine` (TIGHT, greedy): preemptions happen, and every request equals `generate`."""
  params = perturbed_params(cfg)
  reference = np.asarray(greedy_reference(params, cfg, SHORT, LONG_BUDGET).tokens)
  ids = [engine.submit(prompt, max_new_tokens=LONG_BUDGET)[0] for prompt in SHORT]
  done = engine.run(params)
  assert engine.preemptions > 0 and engine.allocator.peak_in_use <= engine.allocator.capacity
  assert engine.allocator.in_use == 0
  for row, seq_id in enumerate(ids):
    np.testing.assert_array_equal(done[seq_id].tokens, reference[row], err_msg=f"request {row}")
    assert done[seq_id].finish_reason == LENGTH
  return done


# Drafting always pays: every step with a draft verifies, so the tests exercise the verify path.
ALWAYS = SpeculativeConfig(drafts=4, verify_cost=1.0)
# The chi-square tests' significance level: a correct sampler fails one with probability 1e-3 (the seed is fixed,
# so the outcome is too). Wrong rules fail it: accepting every draft unchecked with p < 1e-190, keeping matching
# drafts past the first rejection with p < 1e-6 (measured with each patched into the verify program).
ALPHA = 1e-3
# A vocabulary of 5 and 3 sampled tokens: 125 cells, whose exact probabilities one forward gives.
CHI_CFG = ModelConfig(vocab_size=5, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=24,
                      rope_theta=10_000.0, init_std=0.2)
# The n-gram drafter proposes 1, 3 from the first step on, and the policy samples 1 first with probability 0.31.
CHI_PROMPT = [1, 3] * 4
CHI_NEW, CHI_SAMPLES = 3, 4096
# Slots that one group of 64 samples fills: the calls keep few shapes (compilations).
CHI_ENGINE = EngineConfig(max_seqs=64, pages=200, page_size=4, max_seq_len=16, decode_steps=3, prefill_chunk=8,
                          prefill_rows=1)


def exact_joint(params, temperature):
  """The policy's probability of each continuation of CHI_PROMPT by CHI_NEW tokens, in itertools.product order."""
  V, P = CHI_CFG.vocab_size, len(CHI_PROMPT)
  tails = np.asarray(list(itertools.product(range(V), repeat=CHI_NEW)), np.int32)
  tokens = jnp.asarray(np.concatenate([np.tile(CHI_PROMPT, (len(tails), 1)), tails], axis=1))
  # float32 softmax: the sampler's own precision.
  logp = jax.nn.log_softmax(tempered(forward_jit(params, tokens, CHI_CFG), temperature), axis=-1)
  steps = [logp[:, P - 1 + j][np.arange(len(tails)), tails[:, j]] for j in range(CHI_NEW)]
  return np.exp(np.asarray(sum(steps))), tails


def chi_square_p(counts, probs):
  """The p-value of observed counts against probabilities, cells expecting fewer than 5 merged into one."""
  expected = probs * counts.sum()
  small = expected < 5
  observed, expected = counts[~small], expected[~small]
  if small.any():
    observed = np.append(observed, counts[small].sum())
    expected = np.append(expected, probs[small].sum() * counts.sum())
  return stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


def chi_counts(engine, params, temperature):
  """CHI_SAMPLES samples of CHI_PROMPT through `engine`: (counts per cell of `exact_joint`, accepted, drafted)."""
  for _ in range(CHI_SAMPLES // CHI_ENGINE.max_seqs):
    engine.submit(CHI_PROMPT, max_new_tokens=CHI_NEW, samples=CHI_ENGINE.max_seqs)
  done = engine.run(params)
  index = {tuple(t): i for i, t in enumerate(exact_joint(params, temperature)[1].tolist())}
  counts = np.bincount([index[tuple(c.tokens.tolist())] for c in done.values()], minlength=len(index))
  return counts, sum(c.accepted for c in done.values()), sum(c.drafted for c in done.values())
