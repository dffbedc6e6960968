"""Grouped rollouts with shared prompts give the plain forward's scored logits and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_variants import gemma_like
from ptx.models import forward, init_params, kv_cache
from ptx.models.decoder import token_log_probs
from ptx.models.shared_prefix import fits, grouped_logits, rollout_logits

B, G, P, N = 2, 3, 6, 5


def _rollouts(vocab):
  """Left-padded prompts (lengths 6 and 3) repeated G times, then completions; row 1 stops after 2 tokens."""
  rng = np.random.default_rng(0)
  prompt_lengths = np.array([6, 3])
  prompts = rng.integers(1, vocab, (B, P))
  tokens = np.concatenate([np.repeat(prompts, G, axis=0), rng.integers(1, vocab, (B * G, N))], axis=1)
  ends = P + np.full(B * G, N)
  ends[1] = P + 2
  first = P - np.repeat(prompt_lengths, G)
  columns = np.arange(P + N)[None]
  segment_ids = ((columns >= first[:, None]) & (columns < ends[:, None])).astype(np.int32)
  positions = np.maximum(columns - first[:, None], 0).astype(np.int32)
  loss_mask = ((columns >= P) & (columns < ends[:, None])).astype(np.float32)
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(segment_ids), jnp.asarray(loss_mask)


@pytest.mark.parametrize("variant", ["llama", "gemma"])
def test_scored_logits_and_gradients_match_the_plain_forward(tiny_config, variant):
  cfg = tiny_config if variant == "llama" else gemma_like(tiny_config)
  params = init_params(cfg, jax.random.key(1))
  tokens, positions, segment_ids, loss_mask = _rollouts(cfg.vocab_size)

  def scored(logits):
    return token_log_probs(logits[:, :-1], tokens[:, 1:]) * loss_mask[:, 1:]

  plain = lambda p: scored(forward(p, tokens, cfg, positions=positions, segment_ids=segment_ids))
  shared = lambda p: scored(grouped_logits(p, tokens, positions, segment_ids, cfg, group_size=G, prompt_len=P))
  np.testing.assert_allclose(jax.jit(shared)(params), jax.jit(plain)(params), atol=2e-5)
  want = jax.jit(jax.grad(lambda p: plain(p).sum()))(params)
  got = jax.jit(jax.grad(lambda p: shared(p).sum()))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-4), got, want)


def test_rejects_rows_that_are_not_whole_groups_and_rollouts_too_long(tiny_config):
  params = init_params(tiny_config, jax.random.key(1))
  tokens, positions, segment_ids, _ = _rollouts(tiny_config.vocab_size)
  with pytest.raises(ValueError, match="groups of 4"):
    grouped_logits(params, tokens, positions, segment_ids, tiny_config, group_size=4, prompt_len=P)
  assert fits(P, P + N) and not fits(P, kv_cache.BLOCK_SLOTS + 1) and not fits(0, 8)
  long = jnp.zeros((G, kv_cache.BLOCK_SLOTS + 1), jnp.int32)
  with pytest.raises(ValueError, match="does not fit"):
    grouped_logits(params, long, long, long, tiny_config, group_size=G, prompt_len=P)


def test_rollout_logits_shares_prompts_only_when_asked_and_supported(tiny_config):
  params = init_params(tiny_config, jax.random.key(1))
  tokens, positions, segment_ids, loss_mask = _rollouts(tiny_config.vocab_size)
  batch = {"tokens": tokens, "positions": positions, "segment_ids": segment_ids}
  plain = forward(params, tokens, tiny_config, positions=positions, segment_ids=segment_ids)
  # Without a prompt length (or with one group member) it is the plain forward, bit for bit.
  np.testing.assert_array_equal(rollout_logits(params, batch, tiny_config, group_size=G, prompt_len=None), plain)
  np.testing.assert_array_equal(rollout_logits(params, batch, tiny_config, group_size=1, prompt_len=P), plain)
  shared = rollout_logits(params, batch, tiny_config, group_size=G, prompt_len=P)
  np.testing.assert_array_equal(shared[:, :P - 1], 0.0)  # unscored prompt columns
  scored = loss_mask[:, 1:, None] > 0
  np.testing.assert_allclose(np.where(scored, shared[:, :-1], 0), np.where(scored, plain[:, :-1], 0), atol=2e-5)
