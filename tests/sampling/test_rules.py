"""Sampling rules draw from the exact truncated distribution (chi-square on a small vocabulary)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from ptx.sampling.rules import SamplingConfig, invert_cdf, sample_tokens

# 13 distinct logits: V is not a multiple of the sampler's block width (4).
LOGITS = np.array([2.0, 0.3, -1.0, 1.1, 0.0, 2.6, -0.4, 0.8, 1.7, -2.0, 0.5, 1.4, -0.7], np.float32)
N_DRAWS = 40_000

CONFIGS = {
    "temperature": SamplingConfig(temperature=0.6),
    "top_k": SamplingConfig(top_k=4),
    "top_p": SamplingConfig(top_p=0.7),
    "min_p": SamplingConfig(min_p=0.15),
    "all": SamplingConfig(temperature=1.4, top_k=8, top_p=0.85, min_p=0.1),
}


def _exact(logits: np.ndarray, c: SamplingConfig) -> np.ndarray:
  """The target distribution, written independently of the implementation."""
  z = logits.astype(np.float64) / c.temperature
  keep = np.ones_like(z, bool)
  if c.top_k:
    keep &= z >= np.sort(z)[-c.top_k]
  p = np.where(keep, np.exp(z - z.max()), 0.0)
  p /= p.sum()
  if c.top_p < 1:
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    kept = np.zeros_like(keep)
    kept[order[before < c.top_p]] = True
    keep &= kept
  p = np.where(keep, p, 0.0)
  keep &= p >= c.min_p * p.max()
  p = np.where(keep, p, 0.0)
  return p / p.sum()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_draws_follow_the_exact_distribution(name):
  config = CONFIGS[name]
  uniforms = jax.random.uniform(jax.random.key(0), (N_DRAWS,))
  logits = jnp.broadcast_to(jnp.asarray(LOGITS), (N_DRAWS, LOGITS.size))
  draws = np.asarray(jax.jit(sample_tokens, static_argnums=2)(logits, uniforms, config))
  counts = np.bincount(draws, minlength=LOGITS.size)
  expected = _exact(LOGITS, config)
  support = expected > 0
  assert counts[~support].sum() == 0, f"drew truncated tokens: {counts} vs {expected}"
  assert 1 < support.sum() < LOGITS.size or name == "temperature"  # the truncation really truncates
  _, p_value = scipy.stats.chisquare(counts[support], N_DRAWS * expected[support])
  assert p_value > 1e-3, (p_value, counts, N_DRAWS * expected)


def test_invert_cdf_on_a_large_sparse_vocabulary():
  rng = np.random.default_rng(0)
  probs = rng.random(1000) ** 3 * (rng.random(1000) < 0.05)  # ~50 tokens carry all the mass
  probs /= probs.sum()
  uniforms = jax.random.uniform(jax.random.key(1), (N_DRAWS,))
  draws = np.asarray(jax.jit(invert_cdf)(jnp.broadcast_to(jnp.asarray(probs, jnp.float32), (N_DRAWS, 1000)),
                                         uniforms))
  counts = np.bincount(draws, minlength=1000)
  assert counts[probs == 0].sum() == 0
  # Pool the rare tokens so every chi-square cell expects >= 5 draws.
  common = N_DRAWS * probs >= 5
  observed = np.append(counts[common], counts[~common & (probs > 0)].sum())
  expected = np.append(N_DRAWS * probs[common], N_DRAWS * probs[~common].sum())
  assert scipy.stats.chisquare(observed, expected).pvalue > 1e-3


def test_greedy_is_argmax_and_extreme_uniforms_stay_in_support():
  logits = jnp.asarray(np.stack([LOGITS, -LOGITS]))
  np.testing.assert_array_equal(sample_tokens(logits, jnp.zeros(2), SamplingConfig(greedy=True)),
                                np.argmax(np.asarray(logits), axis=-1))
  config = SamplingConfig(top_k=3)
  for u in (0.0, 1.0 - 2.0**-24):
    tokens = np.asarray(sample_tokens(logits, jnp.full((2,), u), config))
    for row in range(2):
      assert tokens[row] in np.argsort(-np.asarray(logits[row]))[:3]


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(min_p=1.5)])
def test_invalid_configs_are_rejected(bad):
  with pytest.raises(ValueError):
    SamplingConfig(**bad)
