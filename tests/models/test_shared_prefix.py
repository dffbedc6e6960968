"""Grouped rollouts with shared prompts give the plain forward's log-probs, entropies and gradients."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_variants import gemma_like
from ptx.models import forward, init_params, kv_cache, shared_prefix
from ptx.models.chunked_logits import logit_stats
from ptx.models.shared_prefix import fits, grouped_stats, prefill_groups, rollout_stats, shares_prompt_cache

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


# "gemma_scanned": the cache path's layers under scans over a stacked cache (`model.decode_loop`, as on GPU and TPU).
@pytest.mark.parametrize("variant", ["llama", "gemma", "gemma_scanned"])
def test_scored_logits_and_gradients_match_the_plain_forward(tiny_config, variant):
  """Copied and shared prompts each give the plain forward's log-probs, entropies and gradients."""
  cfg = {"llama": tiny_config, "gemma": gemma_like(tiny_config),
         "gemma_scanned": dataclasses.replace(gemma_like(tiny_config), decode_loop="scan")}[variant]
  params = init_params(cfg, jax.random.key(1))
  tokens, positions, segment_ids, loss_mask = _rollouts(cfg.vocab_size)

  temperature = 0.7

  def plain(p):
    logits = forward(p, tokens, cfg, positions=positions, segment_ids=segment_ids)[:, :-1]
    stats = logit_stats(logits, tokens[:, 1:], temperature)
    return jnp.stack([stats.log_probs, stats.entropy]) * loss_mask[None, :, 1:]

  def shared(p, shared_prompts):
    stats, _ = grouped_stats(p, tokens, positions, segment_ids, cfg, group_size=G, prompt_len=P,
                             temperature=temperature, shared_prompts=shared_prompts)
    return jnp.stack([stats.log_probs, stats.entropy])[:, :, 1:] * loss_mask[None, :, 1:]

  def scored(stats):
    """(stats(params), the gradient of their sum): one program computes both."""

    def total(p):
      values = stats(p)
      return values.sum(), values

    (_, values), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(params)
    return values, grads

  want, want_grads = scored(plain)
  for shared_prompts in (False, True):
    got, grads = scored(functools.partial(shared, shared_prompts=shared_prompts))
    # A shared prompt merges two softmaxes (prompt keys, own keys) through their log-sum-exps: another order of the
    # float32 sums, a few ulps of log-probs near -6 and entropies near 5.5 (ulp 4.8e-7) through 3 layers (seen 5%
    # of atol, 21% for grads).
    np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"shared_prompts={shared_prompts}")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-4), grads, want_grads)


def test_rejects_rows_that_are_not_whole_groups_and_rollouts_too_long(tiny_config):
  params = init_params(tiny_config, jax.random.key(1))
  tokens, positions, segment_ids, _ = _rollouts(tiny_config.vocab_size)
  with pytest.raises(ValueError, match="groups of 4"):
    grouped_stats(params, tokens, positions, segment_ids, tiny_config, group_size=4, prompt_len=P)
  block = kv_cache.BLOCK_SLOTS
  # Copied prompts: the whole rollout fits one attention block of the cache.
  assert fits(P, P + N, G) and fits(P, block, G) and not fits(P, block + 1, G)
  assert not fits(0, 8, G) and not fits(P, P, G)
  # Shared prompts: the prompt and the completion fit one block each.
  assert fits(P, P + block, G, shared_prompts=True) and fits(block, 2 * block, G, shared_prompts=True)
  assert not fits(P, P + block + 1, G, shared_prompts=True) and not fits(block + 1, block + 2, G, shared_prompts=True)
  long = jnp.zeros((G, block + 1), jnp.int32)
  with pytest.raises(ValueError, match="does not fit"):
    grouped_stats(params, long, long, long, tiny_config, group_size=G, prompt_len=P)


def test_long_prompts_are_held_once_per_group_short_ones_per_row(tiny_config):
  cfg = tiny_config
  params = init_params(cfg, jax.random.key(1))
  tokens, _, segment_ids, _ = _rollouts(cfg.vocab_size)
  lengths = jnp.sum(segment_ids[::G, :P] != 0, axis=1)
  prefill = jax.jit(lambda p, shared: prefill_groups(p, tokens[::G, :P], lengths, cfg, G, new_slots=N,
                                                     shared_prompts=shared), static_argnums=1)
  long = shared_prefix.SHARED_PREFIX_MIN_SLOTS
  assert not shares_prompt_cache(G, P) and shares_prompt_cache(G, long) and not shares_prompt_cache(1, long)
  assert shares_prompt_cache(G, P, shared_prompts=True) and not shares_prompt_cache(G, long, shared_prompts=False)
  kv_heads, head_dim = cfg.n_kv_heads, cfg.head_dim
  copied_logits, copied, _ = prefill(params, None)  # P = 6 columns: copied by default
  assert copied.prefix is None and copied.k[0].shape == (B * G, kv_heads, P + N, head_dim)  # the prompt per row

  logits, cache, _ = prefill(params, True)
  assert cache.prefix.k[0].shape == (B, kv_heads, P, head_dim) and cache.group == G  # the prompts, once
  assert cache.k[0].shape == (B * G, kv_heads, N, head_dim)  # each row's own slots: its new tokens only
  np.testing.assert_array_equal(np.asarray(cache.starts), -np.repeat(np.asarray(lengths), G))
  # The same prefill over caches of P and P + N slots: equal up to the order of the softmax sums.
  np.testing.assert_allclose(np.asarray(cache.prefix.k[0]), np.asarray(copied.k[0][::G, :, :P]), atol=1e-6)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(copied_logits), atol=1e-5)


@pytest.mark.parametrize("execution, shared", [
    ({}, True),
    ({"remat": "full"}, False),  # the cache path's unrolled layers gain nothing from remat: the scan runs
    ({"attention_impl": "blockwise"}, False),  # the configured kernel runs, not the cache's decode attention
])
def test_rollout_stats_share_prompts_only_where_that_runs_the_configured_model(tiny_config, execution, shared):
  cfg = dataclasses.replace(tiny_config, n_layers=1, **execution)
  params = init_params(cfg, jax.random.key(1))
  tokens, positions, segment_ids, _ = _rollouts(cfg.vocab_size)
  batch = {"tokens": tokens, "positions": positions, "segment_ids": segment_ids}
  jaxpr = str(jax.make_jaxpr(lambda p: rollout_stats(p, batch, cfg, group_size=G, prompt_len=P))(params))
  # The plain forward carries every row's whole rollout as one [R, S, D] residual stream; the shared path never does.
  assert (f"f32[{B * G},{P + N},{cfg.d_model}]" not in jaxpr) == shared
