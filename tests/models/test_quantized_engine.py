"""The rollout engine samples from the int8 rollout tree as it is (its log-probs are the int8 model's), and the gap to
the float policy's recomputed log-probs is measured: small and non-zero."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ptx.models.decoder import forward, token_log_probs
from ptx.models.params import init_params
from ptx.models.rollout_params import rollout_params
from ptx.sampling import SamplingConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig
from ptx.train.grpo.metrics import logprob_gap

_forward = jax.jit(forward, static_argnames="cfg")
PROMPTS = [[5, 17, 3], [40, 2, 9, 31, 7, 12], [100]]
N_NEW = 8
CONFIG = EngineConfig(max_seqs=4, pages=32, page_size=4, max_seq_len=16, decode_steps=4, prefill_chunk=8,
                      prefill_rows=2)


def _sampled(cfg, params):
  """Greedy completions of PROMPTS by the engine: (rows of prompt + completion [3, W], response mask, log-probs)."""
  engine = RolloutEngine(cfg, CONFIG, sampling=SamplingConfig(greedy=True))
  ids = [engine.submit(p, max_new_tokens=N_NEW)[0] for p in PROMPTS]
  done = engine.run(params)
  width = max(len(p) for p in PROMPTS) + N_NEW
  tokens, mask, logps = (np.zeros((len(PROMPTS), width), dtype) for dtype in (np.int32, np.float32, np.float32))
  for row, (prompt, i) in enumerate(zip(PROMPTS, ids)):
    n, new = len(prompt), done[i].tokens
    tokens[row, :n + len(new)] = list(prompt) + list(new)
    mask[row, n:n + len(new)] = 1
    logps[row, n:n + len(new)] = done[i].log_probs  # index t holds the log-prob of token t, as GRPO's batches do
  return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(logps)


def _scored(params, cfg, tokens):
  """Log-probs [N, W] of every token after the first under `params` (the loss's recompute; index 0 unused)."""
  logits = _forward(params, tokens, cfg)
  return jnp.pad(token_log_probs(logits[:, :-1], tokens[:, 1:]), ((0, 0), (1, 0)))


def test_int8_rollouts_sample_the_int8_model_and_their_gap_to_the_policy_is_logged(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=2)  # the decode program unrolls its layers: compile time
  params = init_params(cfg, jax.random.key(0))
  rollout = jax.jit(rollout_params, static_argnames="cfg")(params, cfg)

  tokens, mask, logps = _sampled(cfg, rollout)
  # The engine ran the int8 tree: its log-probs are the int8 model's, not the float policy's (1e-2 away, below).
  # The same float32 math summed in another order (paged attention vs the training kernel): a few ulps of log-probs
  # near -4, as for float parameters in tests/sampling/test_engine.py (seen 4.8e-7).
  np.testing.assert_allclose(_scored(rollout, cfg, tokens) * mask, logps, atol=1e-5)
  gap = jax.tree.map(float, logprob_gap(mask, _scored(params, cfg, tokens), logps))
  # The int8 model's log-probs move by about its logits' relative error (~2%, tests/models/test_quantized_weights.py)
  # times the logits' spread (~0.6 nats): around 1e-2 nats per token (seen 5e-3 to 1e-2).
  assert 1e-4 < gap["rollout/logp_gap_abs"] < 0.05, gap
  assert abs(gap["rollout/is_ratio/mean"] - 1.0) < 0.05, gap  # exp(gap) - 1 at most


def test_logprob_gap_is_the_masked_mean_absolute_difference():
  mask = jnp.asarray([[0, 1, 1], [0, 1, 0]])
  policy = jnp.asarray([[0.0, -1.0, -2.0], [0.0, -0.5, -9.0]])
  rollout = jnp.asarray([[0.0, -1.5, -1.0], [0.0, -0.5, 0.0]])
  gap = logprob_gap(mask, policy, rollout)
  np.testing.assert_allclose(gap["rollout/logp_gap_abs"], (0.5 + 1.0 + 0.0) / 3, rtol=1e-6)  # float32 division
  ratios = np.exp([0.5, -1.0, 0.0])  # policy / rollout probability per masked token
  np.testing.assert_allclose(gap["rollout/is_ratio/mean"], ratios.mean(), rtol=1e-6)  # float32 exp and mean
