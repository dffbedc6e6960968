"""GRPO's and DPO's losses through the chunked vocabulary projection equal the dense logits' and stay O(chunk x V)."""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tolerances import assert_close_to_scale
from ptx.algorithms import advantages as adv_lib
from ptx.algorithms import dpo, grpo
from ptx.config import DPOConfig, GRPOConfig, SamplingConfig
from ptx.models import init_params

MiB = 2**20
B, G, P, N = 2, 3, 6, 10  # prompts, group size, prompt columns, completion columns

# Chunked and dense programs score the same float32 logits through other matmul shapes and, on the mesh, other
# shards: float32 sums in another order, ~1e-6 relative. The bound is 1e-5; gradients are held to it
# relative to each leaf's scale (`assert_close_to_scale`), as their near-zero entries cancel larger terms.
TOL = 1e-5


def _grpo_batch(cfg, grpo_cfg, seed=0):
  """B groups of G rollouts sharing a left-padded prompt (lengths 6 and 3), ragged completions, scored."""
  rng = np.random.default_rng(seed)
  prompts = np.repeat(rng.integers(1, cfg.vocab_size, (B, P)), G, axis=0)
  tokens = np.concatenate([prompts, rng.integers(1, cfg.vocab_size, (B * G, N))], axis=1).astype(np.int32)
  first = P - np.repeat([6, 3], G)
  end = P + rng.integers(1, N + 1, B * G)
  columns = np.arange(P + N)[None]
  segment_ids = (columns >= first[:, None]) & (columns < end[:, None])
  loss_mask = (columns >= P) & (columns < end[:, None])
  rewards = jnp.asarray(rng.integers(0, 2, B * G), jnp.float32)
  batch = {
      "tokens": tokens, "positions": np.maximum(columns - first[:, None], 0).astype(np.int32),
      "segment_ids": segment_ids.astype(np.int32), "loss_mask": loss_mask.astype(np.int32),
      "old_logps": (rng.normal(size=tokens.shape) * 0.1 - 5.5).astype(np.float32),
      "ref_logps": (rng.normal(size=tokens.shape) * 0.1 - 5.5).astype(np.float32),
      "advantages": np.asarray(adv_lib.advantages(rewards, G, "grpo")),
  }
  return {**batch, **jax.tree.map(np.asarray, grpo.aggregation_inputs(jnp.asarray(loss_mask), grpo_cfg))}


def _grpo_config():
  # A tempered policy, a trained entropy bonus and KL in the loss: every per-token statistic carries gradient.
  return GRPOConfig(group_size=G, sampling=SamplingConfig(temperature=0.7), beta=0.04, entropy_coef=0.01,
                    max_response_tokens=N)


def _value_and_grad(loss_fn, params, batch):
  return jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, None), has_aux=True))(params)


@pytest.mark.parametrize("mesh_on", [False, True], ids=["one_device", "data2_tensor4"])
def test_grpo_loss_and_gradients_with_chunked_logits_equal_the_dense_computation(tiny_config, mesh, mesh_on):
  cfg = dataclasses.replace(tiny_config, n_layers=2)
  dense, chunked = dataclasses.replace(cfg, logits_chunk=0), dataclasses.replace(cfg, logits_chunk=4)
  grpo_cfg = _grpo_config()
  params = init_params(cfg, jax.random.key(0))
  batch = _grpo_batch(cfg, grpo_cfg)
  loss = lambda model, prompt_len: functools.partial(grpo.loss, model=model, grpo=grpo_cfg, prompt_len=prompt_len)
  # The dense computation: [R, S, V] logits of the plain forward.
  (want, want_metrics), want_grads = _value_and_grad(loss(dense, None), params, batch)
  # Chunked: 4 tokens per device and chunk, which the 6 (3 per device on the mesh) rows split into one position
  # each per chunk, through the plain forward and through the shared-prompt path, whose prompts run once per group.
  # (tests/models/test_chunked_logits.py covers a padded last chunk.)
  for prompt_len in (None, P):
    with jax.set_mesh(mesh) if mesh_on else contextlib.nullcontext():
      (got, got_metrics), got_grads = _value_and_grad(loss(chunked, prompt_len), params, batch)
    np.testing.assert_allclose(got, want, rtol=TOL, err_msg=f"prompt_len={prompt_len}")
    for name in ("actor/entropy", "actor/kl_loss", "actor/pg_loss"):
      np.testing.assert_allclose(got_metrics[name], want_metrics[name], rtol=TOL, err_msg=name)
    jax.tree.map(lambda a, b: assert_close_to_scale(a, b, TOL), got_grads, want_grads)


def test_dpo_loss_and_gradients_with_chunked_logits_equal_the_dense_computation(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=2)
  rng = np.random.default_rng(0)

  def side(seed_rows):
    tokens = rng.integers(1, cfg.vocab_size, (3, 20)).astype(np.int32)
    segment_ids = (np.arange(20)[None] < np.asarray(seed_rows)[:, None]).astype(np.int32)
    return {"tokens": tokens, "positions": np.tile(np.arange(20, dtype=np.int32), (3, 1)),
            "segment_ids": segment_ids, "loss_mask": segment_ids * (np.arange(20)[None] >= 5)}

  batch = {"chosen": side([20, 12, 9]), "rejected": side([15, 20, 7]),
           "ref_chosen_logps": np.asarray([-60.0, -40.0, -20.0], np.float32),
           "ref_rejected_logps": np.asarray([-50.0, -62.0, -10.0], np.float32)}
  params = init_params(cfg, jax.random.key(0))
  loss = lambda model: functools.partial(dpo.loss, model=model, dpo=DPOConfig(beta=0.1))
  (want, _), want_grads = _value_and_grad(loss(dataclasses.replace(cfg, logits_chunk=0)), params, batch)
  (got, metrics), got_grads = _value_and_grad(loss(dataclasses.replace(cfg, logits_chunk=7)), params, batch)
  np.testing.assert_allclose(got, want, rtol=TOL)
  assert float(metrics["logps/chosen"]) < -10  # summed over real targets, not a mean
  jax.tree.map(lambda a, b: assert_close_to_scale(a, b, TOL), got_grads, want_grads)


@pytest.mark.parametrize("prompt_len", [None, 64], ids=["plain_forward", "shared_prompts"])
def test_grpo_loss_memory_does_not_grow_with_tokens_times_vocab(tiny_config, prompt_len):
  vocab = 16384
  cfg = dataclasses.replace(tiny_config, vocab_size=vocab, n_layers=1, attention_impl="blockwise")
  params = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
  grpo_cfg = dataclasses.replace(_grpo_config(), group_size=4)
  # The plain forward: 4 rows of up to 2048 columns (blockwise attention is O(T)). Shared prompts: 16 rows of a
  # 64-column prompt and 512 completion columns, the most one cache attention block holds.
  rows, columns = (4, 2048) if prompt_len is None else (16, 64 + 512)

  def temp(s, chunk):
    ints, floats = jax.ShapeDtypeStruct((rows, s), jnp.int32), jax.ShapeDtypeStruct((rows, s), jnp.float32)
    batch = {"tokens": ints, "positions": ints, "segment_ids": ints, "loss_mask": ints, "old_logps": floats,
             "ref_logps": floats, "agg_weights": floats, "advantages": jax.ShapeDtypeStruct((rows,), jnp.float32),
             "agg_total": jax.ShapeDtypeStruct((rows,), jnp.float32)}
    loss = functools.partial(grpo.loss, model=dataclasses.replace(cfg, logits_chunk=chunk), grpo=grpo_cfg,
                             prompt_len=prompt_len)
    program = jax.jit(jax.grad(lambda p, b: loss(p, b, None)[0]))
    return program.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  dense, chunked = temp(columns, 0), temp(columns, 1024)
  logits = rows * columns * vocab * 4  # one float32 [R, S, V] array: 512 MiB plain, 576 MiB shared
  # The dense program holds the logits and their softmax and gradients; the chunked one none of them.
  assert dense - chunked > logits, f"dense {dense / MiB:.0f} MiB, chunked {chunked / MiB:.0f} MiB"
  if prompt_len is None:
    # Half the columns: the dense path shrinks by 2048 tokens' logits and more, the chunked one by their
    # activations (~20 MiB here). (The cache attention of shared prompts is quadratic in the completion.)
    half = rows * columns // 2 * vocab * 4
    assert dense - temp(columns // 2, 0) > half
    assert chunked - temp(columns // 2, 1024) < half / 8
