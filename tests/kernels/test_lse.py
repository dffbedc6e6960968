"""merge_lse: partial attention over disjoint key sets merges exactly."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

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
