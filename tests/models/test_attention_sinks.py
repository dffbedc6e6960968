"""Attention sinks equal transformers' gpt_oss attention in every implementation of `attention`, forward and backward.

The reference is gpt_oss's eager attention written in plain jnp: each head's sink is one more logit column of the
softmax, dropped before the values. One input set covers grouped queries (8 heads over 4), a packed row with two
documents and four padding queries that see no key, a sliding window and a soft-cap; dimensions are pairwise
distinct. Gradients are taken in q, k, v and the sinks. The Pallas kernels run through the Pallas interpreter.
"""

import contextlib
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tolerances import assert_close_to_scale
from ptx.config import MeshConfig
from ptx.models import kv_cache, paged_kv_cache
from ptx.models.attention import attention, interpret_pallas
from ptx.sharding import make_mesh

B, T, H, N, D = 2, 24, 8, 4, 16
WINDOW, SOFTCAP = 9, 5.0
SEGMENTS = jnp.asarray([[1] * 13 + [2] * 7 + [0] * 4, [1] * T], jnp.int32)
POSITIONS = jnp.asarray([list(range(13)) + list(range(7)) + [0] * 4, list(range(T))], jnp.int32)
# Kernels tile the softmax and its gradients and sum them in another order than the reference: float32 rounding,
# ~1e-6 of each array's scale (as in tests/models/test_attention.py).
REL = 1e-5


def _inputs():
  """q [B, T, H, D], k and v [B, T, N, D], sinks [H] float32, and the loss's weights on the output."""
  kq, kk, kv, ks, kw = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(kq, (B, T, H, D), jnp.float32)
  k = jax.random.normal(kk, (B, T, N, D), jnp.float32)
  v = jax.random.normal(kv, (B, T, N, D), jnp.float32)
  sinks = 1.5 * jax.random.normal(ks, (H,), jnp.float32)  # from well below to well above the rows' lse
  return q, k, v, sinks, jax.random.normal(kw, (B, T, H, D), jnp.float32)


def _visible(segments, positions, window):
  """[B, T, S] keys each query sees: same non-zero segment, causal, within the window."""
  distance = positions[:, :, None] - positions[:, None, :]
  same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] != 0)
  return same & (distance >= 0) & (distance < window)


def _concat_softmax(q, k, v, sinks, visible, softcap):
  """gpt_oss eager attention: softmax over [logits, sink], the sink's column dropped, times repeated values."""
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)  # transformers' repeat_kv
  logits = jnp.einsum("bthd,bshd->bhts", q, k, precision=jax.lax.Precision.HIGHEST) * q.shape[-1] ** -0.5
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  logits = jnp.where(visible[:, None], logits, -jnp.inf)
  sink_column = jnp.broadcast_to(sinks[None, :, None, None], logits.shape[:3] + (1,))
  probs = jax.nn.softmax(jnp.concatenate([logits, sink_column], axis=-1), axis=-1)[..., :-1]
  return jnp.einsum("bhts,bshd->bthd", probs, v, precision=jax.lax.Precision.HIGHEST)


def _loss_and_grads(fn, q, k, v, sinks, weights):
  """(out, grads in q, k, v and sinks) of sum(out * weights), in one jitted program."""
  def loss(q, k, v, sinks):
    out = fn(q, k, v, sinks)
    return jnp.sum(out * weights), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
  return out, grads


def _mesh(**axes):
  """A context with a mesh of the given axis sizes over the 8 fake devices."""
  return jax.set_mesh(make_mesh(MeshConfig(**{"data": 1, "fsdp": 1, **axes})))


# (impl, the contexts it runs in). Under the data x tensor mesh the per-device kernels hold 2 of the 8 heads each, and
# the sinks must be split like them; the ring's sinks apply once, after its 4 hops merge.
CASES = {
    "xla": ("xla", lambda: []),
    "blockwise/heads_sharded": ("blockwise", lambda: [_mesh(data=2, tensor=4)]),
    "pallas_gpu/heads_sharded": ("pallas", lambda: [_mesh(data=2, tensor=4), interpret_pallas("pallas_gpu")]),
    "pallas_tpu": ("pallas", lambda: [interpret_pallas("pallas_tpu")]),
    "ring/seq4": ("ring", lambda: [_mesh(tensor=2, seq=4)]),
}


@pytest.mark.parametrize("case", CASES)
def test_every_implementation_matches_the_concat_softmax_reference(case):
  q, k, v, sinks, weights = _inputs()
  impl, contexts = CASES[case]
  ours = lambda q, k, v, sinks: attention(q, k, v, segment_ids=SEGMENTS, positions=POSITIONS, impl=impl,
                                          window=WINDOW, softcap=SOFTCAP, sinks=sinks)
  with contextlib.ExitStack() as stack:
    for context in contexts():
      stack.enter_context(context)
    out, grads = _loss_and_grads(ours, q, k, v, sinks, weights)
  visible = _visible(SEGMENTS, POSITIONS, WINDOW)
  reference = lambda q, k, v, sinks: _concat_softmax(q, k, v, sinks, visible, SOFTCAP)
  want, want_grads = _loss_and_grads(reference, q, k, v, sinks, weights)
  assert np.all(np.asarray(out)[0, 20:] == 0)  # padding queries see no key: zeros, as without sinks
  assert_close_to_scale(out, want, REL)
  for got, expected in zip(grads, want_grads):
    assert_close_to_scale(got, expected, REL)


def test_the_sinks_move_the_reference_far_beyond_the_tolerance():
  # Else an implementation that ignored them could pass the comparisons above.
  q, k, v, sinks, _ = _inputs()
  reference = jax.jit(_concat_softmax, static_argnums=5)
  visible = _visible(SEGMENTS, POSITIONS, WINDOW)
  with_sinks = reference(q, k, v, sinks, visible, SOFTCAP)
  # A sink of -1e30 takes no weight, yet keeps the padding rows' softmax finite (all -inf would be NaN).
  without = reference(q, k, v, jnp.full((H,), -1e30), visible, SOFTCAP)
  assert float(jnp.max(jnp.abs(with_sinks - without))) > 1e3 * REL * float(jnp.max(jnp.abs(without)))


def test_sinks_match_transformers_gpt_oss_eager_attention():
  torch = pytest.importorskip("torch", reason="HF parity tests need torch (installed by `make test`)")
  gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
  q, k, v, sinks, _ = _inputs()
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  ones = jnp.ones((B, T), jnp.int32)
  visible = _visible(ones, positions, WINDOW)
  mask = torch.tensor(np.where(np.asarray(visible), 0.0, -np.inf)[:, None], dtype=torch.float32)
  module = types.SimpleNamespace(sinks=torch.tensor(np.asarray(sinks)), num_key_value_groups=H // N, training=False)
  heads_first = lambda x: torch.tensor(np.asarray(x)).transpose(1, 2)
  want, _ = gpt_oss.eager_attention_forward(module, heads_first(q), heads_first(k), heads_first(v), mask,
                                            scaling=D ** -0.5)
  got = attention(q, k, v, segment_ids=ones, positions=positions, window=WINDOW, sinks=sinks)
  # float32 on both sides, summed in another order: ~1e-6 of the scale.
  assert_close_to_scale(got, want.numpy(), REL)


def test_sinks_that_are_not_one_per_query_head_are_refused_before_the_heads_are_split():
  q, k, v, _, _ = _inputs()
  with _mesh(data=2, tensor=4), pytest.raises(ValueError, match=r"sinks must be a float \[H\] = \[8\]"):
    attention(q, k, v, segment_ids=SEGMENTS, positions=POSITIONS, impl="blockwise", sinks=jnp.zeros((4,)))


def test_the_caches_attend_with_sinks_as_attention_does():
  """Prefill then decode against the contiguous cache (its own slots; a group's shared prompt merged in) and the
  paged one (a row's pages merged by segments) equal `attention` with sinks over the whole rows."""
  q, k, v, sinks, _ = _inputs()
  prompt, n = 8, 12  # a shared prompt of 8 tokens, then 4 of each row's own
  k, v = k.at[1, :prompt].set(k[0, :prompt]), v.at[1, :prompt].set(v[0, :prompt])  # two rows of one prompt
  positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))
  want = attention(q[:, :n], k[:, :n], v[:, :n], segment_ids=jnp.ones((B, n), jnp.int32), positions=positions,
                   impl="xla", sinks=sinks)
  calls = ((0, prompt), (prompt, prompt + 1), (prompt + 1, n))  # prefill, one decode step, a chunk of three

  @functools.partial(jax.jit, static_argnums=1)  # one program per cache: eager, each op would compile alone
  def run(cache, calls):
    outs = []
    for start, stop in calls:
      if isinstance(cache, paged_kv_cache.PagedKVCache):  # its rows take this call's tokens
        cache = dataclasses.replace(cache, new_tokens=jnp.full((B,), stop - start, jnp.int32))
      out, cache = cache.attend(0, q[:, start:stop], k[:, start:stop], v[:, start:stop],
                                positions=positions[:, start:stop], window=None, softcap=None, scale=D ** -0.5,
                                sinks=sinks)
      outs.append(out)
      cache = cache.advance(stop - start)
    return jnp.concatenate(outs, axis=1)

  # The fields the caches read: one layer of N heads with values, each layer its own arrays (decode_loop "unroll").
  cfg = types.SimpleNamespace(n_layers=1, cache_kv_heads=N, cache_head_dim=D, compute_dtype=jnp.float32,
                              cache_values=True, decode_loop="unroll")
  # As REL: the same float32 softmax in another order of sums.
  np.testing.assert_allclose(run(kv_cache.init_cache(cfg, B, 16), calls), want, atol=REL, rtol=REL)
  # The prompt once in a prefix cache of one row, each row's own tokens in a cache of two.
  prefix = kv_cache.init_cache(cfg, 1, 16)
  _, prefix = prefix.attend(0, q[:1, :prompt], k[:1, :prompt], v[:1, :prompt], positions=positions[:1, :prompt],
                            window=None, softcap=None, scale=D ** -0.5)
  shared = kv_cache.share_prefix(prefix.advance(prompt), group=2, slots=8)
  np.testing.assert_allclose(run(shared, calls[1:]), want[:, prompt:], atol=REL, rtol=REL)
  # Pages of 4 slots: row 0 on pages 1-3, row 1 on 4-6, read as (row, page) pairs that split each row's softmax.
  table = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
  pairs = paged_kv_cache.Pairs(rows=jnp.repeat(jnp.arange(2, dtype=jnp.int32), 3), pages=table.reshape(-1),
                               index=jnp.tile(jnp.arange(3, dtype=jnp.int32), 2))
  pool = jnp.zeros((7, N, 4, D), jnp.float32)  # page 0 is the sink page no row reads
  paged = paged_kv_cache.PagedKVCache(k=(pool,), v=(pool,), page_table=table, lengths=jnp.zeros((B,), jnp.int32),
                                      new_tokens=jnp.zeros((B,), jnp.int32), pairs=pairs)
  np.testing.assert_allclose(run(paged, calls), want, atol=REL, rtol=REL)
