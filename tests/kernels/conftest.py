"""Random attention inputs and error measures shared by the kernel tests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def rel_err(got, want) -> float:
  """max |got - want| / max |want|, in float64 on the host."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def make_qkv(seed, b, t, s, h, kv, d, dtype=jnp.float32):
  """Fresh normal q [B,T,H,D], k/v [B,S,KV,D]."""
  kq, kk, kv_ = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (b, t, h, d), dtype),
          jax.random.normal(kk, (b, s, kv, d), dtype),
          jax.random.normal(kv_, (b, s, kv, d), dtype))


def ragged_segments(seed, b, t, max_docs=4):
  """Packed segment ids [B, T]: random document lengths, then 0-padding."""
  rng = np.random.default_rng(seed)
  out = np.zeros((b, t), np.int32)
  for row in range(b):
    used = int(rng.integers(t // 2, t + 1))
    cuts = np.sort(rng.choice(np.arange(1, used), size=max_docs - 1, replace=False))
    out[row, :used] = np.searchsorted(cuts, np.arange(used), side="right") + 1
  return jnp.asarray(out)


def loss_terms(fn):
  """A scalar of out and lse with random cotangents, for gradient checks."""
  def loss(q, k, v):
    out, lse = fn(q, k, v)
    w_out = jax.random.normal(jax.random.key(7), out.shape, jnp.float32)
    w_lse = jax.random.normal(jax.random.key(8), lse.shape, jnp.float32)
    finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(finite_lse * w_lse)
  return loss


def outputs_and_grads(fn, q, k, v):
  """(out, lse, (dq, dk, dv)) from one jitted program (one compile)."""
  def loss(q, k, v):
    out, lse = fn(q, k, v)
    return loss_terms(lambda *_: (out, lse))(q, k, v), (out, lse)
  (_, (out, lse)), grads = jax.jit(
      jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  return out, lse, grads


def assert_matches(fast, slow, q, k, v, tol=1e-5):
  """fast == slow on out, finite lse and gradients; slow runs in float32.

  tol bounds rel_err (relative to the largest reference value). 1e-5 for float32: tiles and blocks sum the softmax
  and its gradients in another order, ~1e-6 of the scale (seen <= 6.1e-7). Callers with bfloat16 inputs pass 1e-2:
  the kernel's bfloat16 outputs and gradients keep 8 mantissa bits, a rounding of up to 2^-9 = 0.2% at each of
  several steps (seen <= 0.41%; a float32 reordering can flip one such rounding, adding at most 2^-8 = 0.39%).
  """
  out, lse, grads = outputs_and_grads(fast, q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  ref_out, ref_lse, ref_grads = outputs_and_grads(slow, *f32)
  assert out.dtype == q.dtype and rel_err(out, ref_out) < tol
  finite = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  assert rel_err(np.asarray(lse)[finite], np.asarray(ref_lse)[finite]) < tol
  for g, r, x in zip(grads, ref_grads, (q, k, v)):
    assert g.dtype == x.dtype and np.all(np.isfinite(np.asarray(g, np.float32)))
    assert rel_err(g, r) < tol
  return out, lse, grads


@pytest.fixture
def helpers():
  """The helpers above, as a fixture (tests/ is not a package)."""
  class H:
    pass
  for f in (rel_err, make_qkv, ragged_segments, loss_terms, outputs_and_grads,
            assert_matches):
    setattr(H, f.__name__, staticmethod(f))
  return H
