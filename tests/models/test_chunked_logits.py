"""Chunked output projection == full logits, and its memory does not grow with tokens x vocab."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptx.algorithms import sft
from ptx.config import MeshConfig
from ptx.models import forward, init_params
from ptx.models.chunked_logits import token_stats
from ptx.sharding import make_mesh

MiB = 2**20


def _batch(cfg, b, t, seed=0):
  rng = np.random.default_rng(seed)
  seg = np.ones((b, t), np.int32)
  seg[:, t // 3:] = 2  # two packed documents per row
  seg[0, -5:] = 0  # and some padding
  pos = np.where(seg == 2, np.arange(t) - t // 3, np.arange(t)).astype(np.int32)
  return {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32),
          "loss_mask": jnp.asarray(rng.random((b, t)) < 0.8, jnp.int32),
          "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos * (seg > 0))}


@pytest.mark.parametrize("mesh_cfg", [None, MeshConfig(data=2, fsdp=1, tensor=1, seq=4)])
def test_chunked_equals_full_logits(tiny_config, mesh_cfg):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  params = init_params(cfg, jax.random.key(0))
  batch = _batch(cfg, 2, 44)
  # 10 tokens per device and chunk: without a mesh 9 chunks of 5 positions of both rows (44 padded to 45), on
  # (data 2, seq 4) 2 chunks of 6 positions of each shard's 11: both pad the last chunk.
  chunked = dataclasses.replace(cfg, logits_chunk=10)

  def run(c):
    stats, _ = jax.jit(functools.partial(token_stats, cfg=c))(
        params, batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    loss_and_grad = jax.jit(jax.value_and_grad(functools.partial(sft.loss, model=c), has_aux=True))
    return stats, loss_and_grad(params, batch, None)

  want_stats, ((want_loss, _), want_grads) = run(cfg)
  if mesh_cfg is None:
    got_stats, ((got_loss, _), got_grads) = run(chunked)
  else:
    with jax.set_mesh(make_mesh(mesh_cfg)):
      got_stats, ((got_loss, _), got_grads) = run(chunked)
  # The chunked projection runs other matmul shapes and, on the mesh, other shards: float32 sums in another order.
  # The entropy sums 264 vocab terms of values near ln 264 = 5.6 (ulp 4.8e-7): it came within 37% of rtol 1e-6, so
  # rtol 1e-5 (the typical sqrt(264) ulps of such a sum, ~1e-6 relative, with room for another CPU's vector width).
  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
  close(got_stats.log_probs, want_stats.log_probs)
  close(got_stats.entropy, want_stats.entropy)
  np.testing.assert_array_equal(got_stats.correct, want_stats.correct)  # argmax: moves only on a tie within rounding
  close(got_loss, want_loss)
  jax.tree.map(lambda a, b: close(np.asarray(a), np.asarray(b)), got_grads, want_grads)


def test_token_stats_score_each_token_given_its_prefix(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1, logits_chunk=2)
  params = init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
  logp = jax.nn.log_softmax(forward(params, tokens, cfg), axis=-1)
  want = np.take_along_axis(np.asarray(logp[:, :-1]), np.asarray(tokens[:, 1:, None]), -1)[..., 0]
  got = token_stats(params, tokens, cfg)[0].log_probs
  np.testing.assert_array_equal(got[:, 0], 0.0)
  # Chunked token stats vs jax.nn.log_softmax of the full logits: reordered float32 sums (seen 7% of this).
  np.testing.assert_allclose(got[:, 1:], want, rtol=1e-6, atol=1e-6)


def test_chunked_loss_memory_does_not_grow_with_tokens_times_vocab(tiny_config):
  vocab = 16384
  cfg = dataclasses.replace(tiny_config, vocab_size=vocab, n_layers=1, attention_impl="blockwise")
  params = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))

  def temp(t, chunk):
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32)
    batch = {"tokens": ids, "loss_mask": ids, "segment_ids": ids, "positions": ids}
    loss = functools.partial(sft.loss, model=dataclasses.replace(cfg, logits_chunk=chunk))
    program = jax.jit(jax.grad(lambda p, b: loss(p, b, None)[0]))
    return program.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  extra_logits = 4096 * vocab * 4  # 4096 more tokens of float32 logits: 256 MiB
  full_growth = temp(8192, 0) - temp(4096, 0)
  chunked_growth = temp(8192, 256) - temp(4096, 256)
  assert full_growth > extra_logits, f"full logits path grew {full_growth / MiB:.0f} MiB"
  # The chunked path grows by the activations of 4096 tokens (~20 MiB here), not [T, V].
  assert chunked_growth < extra_logits / 8, f"chunked path grew {chunked_growth / MiB:.0f} MiB"
