"""merge_lse: partial attention over disjoint key sets merges exactly."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ptx_kernels as pk


def test_halves_merge_to_the_whole_with_matching_grads(helpers):
  q, k, v = helpers.make_qkv(0, 2, 16, 32, 4, 2, 8)
  pos = dict(q_positions=jnp.broadcast_to(jnp.arange(16, 32), (2, 16)))
  ref = functools.partial(pk.reference_attention, causal=True)

  def merged(q, k, v):
    parts = [ref(q, k[:, a:a + 16], v[:, a:a + 16], **pos,
                 kv_positions=jnp.broadcast_to(jnp.arange(a, a + 16), (2, 16)))
             for a in (0, 16)]
    return pk.merge_lse([p[0] for p in parts], [p[1] for p in parts])

  whole = lambda q, k, v: ref(q, k, v, **pos,
                              kv_positions=jnp.broadcast_to(jnp.arange(32), (2, 32)))
  helpers.assert_matches(merged, whole, q, k, v)


def test_all_empty_parts_give_zero_and_finite_grads():
  out = jnp.ones((1, 3, 2, 4))
  lse = jnp.full((1, 2, 3), -jnp.inf)

  def total(out, lse):
    merged, merged_lse = pk.merge_lse([out, out], [lse, lse])
    return jnp.sum(merged) + jnp.sum(jnp.where(jnp.isfinite(merged_lse), merged_lse, 0))

  merged, merged_lse = pk.merge_lse([out, out], [lse, lse])
  assert np.all(np.asarray(merged) == 0) and np.all(np.isneginf(merged_lse))
  grads = jax.grad(total, (0, 1))(out, lse)
  assert all(np.all(np.isfinite(g)) for g in grads)


def _concat_softmax(q, k, v, sinks, kv_positions):
  """(out, lse) of causal attention with each head's sink as one more logit column, dropped before the values.

  gpt_oss's eager attention, plus the log-sum-exp of the softmax's denominator, sink included.
  """
  g = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  logits = jnp.einsum("bthd,bshd->bhts", q, k, precision=jax.lax.Precision.HIGHEST) * q.shape[-1] ** -0.5
  q_positions = jnp.arange(kv_positions.shape[-1] - q.shape[1], kv_positions.shape[-1])
  logits = jnp.where(kv_positions[None, None, None, :] <= q_positions[None, None, :, None], logits, -jnp.inf)
  sink_column = jnp.broadcast_to(sinks[None, :, None, None], logits.shape[:3] + (1,))
  combined = jnp.concatenate([logits, sink_column], axis=-1)
  probs = jax.nn.softmax(combined, axis=-1)[..., :-1]
  out = jnp.einsum("bhts,bshd->bthd", probs, v, precision=jax.lax.Precision.HIGHEST)
  return out, jax.nn.logsumexp(combined, axis=-1)


def test_sinks_after_merging_parts_equal_the_concat_softmax_with_matching_grads(helpers):
  # Two key halves merged, then the sinks once (as the ring and split-cache decode must): the reference's one
  # softmax over all keys and the sink column, forward and gradients in q, k, v and the sinks.
  b, t, s, h, kv, d = 2, 5, 12, 6, 3, 4
  q, k, v = helpers.make_qkv(3, b, t, s, h, kv, d)
  sinks = jax.random.normal(jax.random.key(4), (h,), jnp.float32)
  q_positions = dict(q_positions=jnp.broadcast_to(jnp.arange(s - t, s), (b, t)))

  def merged(q, k, v, sinks):
    parts = [pk.reference_attention(q, k[:, a:a + 6], v[:, a:a + 6], **q_positions,
                                    kv_positions=jnp.broadcast_to(jnp.arange(a, a + 6), (b, 6)))
             for a in (0, 6)]
    out, lse = pk.merge_lse([p[0] for p in parts], [p[1] for p in parts])
    return pk.with_sinks(out, lse, sinks)

  whole = lambda q, k, v, sinks: _concat_softmax(q, k, v, sinks, jnp.arange(s))
  weights = jax.random.normal(jax.random.key(5), (b, t, h, d), jnp.float32)
  lse_weights = jax.random.normal(jax.random.key(6), (b, h, t), jnp.float32)

  def run(fn):
    def loss(*x):
      out, lse = fn(*x)
      return jnp.sum(out * weights) + jnp.sum(lse * lse_weights), (out, lse)
    (_, outputs), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    return outputs, grads

  (out, lse), grads = run(merged)
  (want_out, want_lse), want_grads = run(whole)
  # float32 sums in another order (two parts, then the sink): ~1e-6 of the scale.
  assert helpers.rel_err(out, want_out) < 1e-5 and helpers.rel_err(lse, want_lse) < 1e-5
  for g, w in zip(grads, want_grads):
    assert helpers.rel_err(g, w) < 1e-5


def test_sinks_keep_an_empty_row_zero_with_finite_grads():
  out = jnp.ones((1, 3, 2, 4))
  lse = jnp.asarray([[[-jnp.inf, 0.5, -jnp.inf], [1.0, -jnp.inf, 2.0]]])
  sinks = jnp.asarray([0.25, -1.5])

  def total(out, lse, sinks):
    new_out, new_lse = pk.with_sinks(out, lse, sinks)
    return jnp.sum(new_out) + jnp.sum(new_lse)

  new_out, new_lse = pk.with_sinks(out, lse, sinks)
  empty = np.isneginf(np.asarray(lse))
  assert np.all(np.asarray(new_out).transpose(0, 2, 1, 3)[empty] == 0)
  np.testing.assert_array_equal(np.asarray(new_lse)[empty], np.broadcast_to(np.asarray(sinks)[None, :, None],
                                                                            lse.shape)[empty])
  d_out, d_lse, d_sinks = jax.grad(total, (0, 1, 2))(out, lse, sinks)
  assert all(np.all(np.isfinite(g)) for g in (d_out, d_lse, d_sinks))
  assert np.all(np.asarray(d_lse)[empty] == 0)  # an empty row's lse moves nothing


def test_sinks_of_the_wrong_shape_are_refused():
  with pytest.raises(ValueError, match=r"sinks must be a float \[H\] = \[2\]"):
    pk.with_sinks(jnp.zeros((1, 3, 2, 4)), jnp.zeros((1, 2, 3)), jnp.zeros((3,)))
