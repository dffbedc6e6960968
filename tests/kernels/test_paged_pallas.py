"""The Pallas paged attention kernels (TPU and GPU, interpreted on CPU) == the pure-JAX paged_attention.

`tests/kernels/test_paged.py` holds the pure-JAX path ("xla") to `reference_attention`; here each kernel is held to
that path on one ragged case (pages shared between rows, a row with no pairs, a row that only padding pairs name,
lengths ending mid-page, GQA) for decode (T = 1), a prefill chunk (T = 22) with a window and a softcap, and bfloat16.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ptx_kernels as pk

# Page size and head dims: powers of two >= 16, as the GPU kernel needs, and pairwise distinct (the values' head dim
# too), so a swapped axis cannot pass.
S, KV, H, D, DV = 16, 2, 6, 32, 64
KERNELS = ("pallas_tpu", "pallas_gpu")
# Row 0 holds pages 3, 5, 1; row 1 shares its first two (a group's prompt), then its own 7; row 2 holds nothing and
# no pair names it; row 3 holds one page; row 4 holds nothing and only the padding pairs name it. Lengths end
# mid-page.
TABLES = [[3, 5, 1], [3, 5, 7], [], [9], []]
LENGTHS = np.array([37, 41, 0, 5, 0], np.int32)
# Float32 on both sides, the softmax summed page by page in another order: a few ulps of the largest value (seen
# <= 1e-7).
F32_TOL = 1e-5
# bfloat16 inputs against the pure-JAX path on their float32 values: the kernel rounds the probabilities to
# bfloat16 before the value product and its output to bfloat16, 2^-9 = 0.2% each (the reasoning of conftest's
# assert_matches, which allows 1e-2 for it). The logits are exact products of bfloat16 values summed in float32,
# so lse keeps F32_TOL (seen: out 0.2%, lse 7e-8).
BF16_TOL = 1e-2


def _pairs(pad: int):
  """(rows, pages, index) of TABLES, then `pad` padding pairs on the last row, past every length."""
  rows = [r for r, t in enumerate(TABLES) for _ in t] + [len(TABLES) - 1] * pad
  pages = [p for t in TABLES for p in t] + [0] * pad
  index = [i for t in TABLES for i in range(len(t))] + [10 ** 6] * pad
  return tuple(jnp.asarray(x, jnp.int32) for x in (rows, pages, index))


def _inputs(t: int, dtype, seed=0):
  """q [R, T, H, D], the pools and the queries' positions (the last T positions of each row)."""
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(len(TABLES), t, H, D))
  k_pages, v_pages = rng.normal(size=(12, KV, S, D)), rng.normal(size=(12, KV, S, DV))
  q_positions = np.maximum(LENGTHS[:, None] - t + np.arange(t)[None], 0).astype(np.int32)
  return *(jnp.asarray(x, dtype) for x in (q, k_pages, v_pages)), jnp.asarray(q_positions)


@functools.partial(jax.jit, static_argnames=("impl", "causal", "softcap"))
def _attend(q, k_pages, v_pages, q_positions, window, *, impl, causal, softcap):
  """paged_attention over TABLES with a traced window (None for none)."""
  rows, pages, index = _pairs(pad=3)
  return pk.paged_attention(q, k_pages, v_pages, rows=rows, pages=pages, index=index, lengths=LENGTHS,
                            q_positions=q_positions, causal=causal, window=window, softcap=softcap, impl=impl,
                            interpret=impl != "xla")


# t=1: decode (3 query rows per kv head, padded to 16); t=22: a prefill chunk of 66 rows, more than one GPU tile.
# The window is a jit argument, so the kernels see it traced, as a scan over layers passes it.
@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("t, dtype, causal, window, softcap, tol", [
    (1, jnp.float32, True, None, None, F32_TOL),
    (22, jnp.float32, True, 20, 4.0, F32_TOL),
    (2, jnp.bfloat16, False, 9, None, BF16_TOL),
])
def test_matches_the_pure_jax_path(helpers, impl, t, dtype, causal, window, softcap, tol):
  q, k_pages, v_pages, q_positions = _inputs(t, dtype)
  kw = dict(causal=causal, softcap=softcap)
  out, lse = _attend(q, k_pages, v_pages, q_positions, window, impl=impl, **kw)
  f32 = [x.astype(jnp.float32) for x in (q, k_pages, v_pages)]
  want, want_lse = _attend(*f32, q_positions, window, impl="xla", **kw)
  assert out.dtype == dtype and lse.dtype == jnp.float32
  assert helpers.rel_err(out, want) < tol
  live = LENGTHS > 0
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(np.asarray(want_lse)))
  assert helpers.rel_err(np.asarray(lse)[live], np.asarray(want_lse)[live]) < F32_TOL
  # Rows that see no key, with no pair or padding pairs only: zeros and -inf, never NaN.
  assert np.all(np.asarray(out)[~live] == 0) and np.all(np.isneginf(np.asarray(lse)[~live]))


def test_auto_is_the_pure_jax_path_on_cpu():
  q, k_pages, v_pages, q_positions = _inputs(1, jnp.float32)
  auto, xla = (_attend(q, k_pages, v_pages, q_positions, None, impl=impl, causal=True, softcap=None)
               for impl in ("auto", "xla"))
  np.testing.assert_array_equal(np.asarray(auto[0]), np.asarray(xla[0]))


def _call(q_shape=(5, 1, H, D), pool_shape=(12, KV, S, D), **kw):
  """paged_attention on zeros of these shapes."""
  rows, pages, index = _pairs(pad=0)
  return pk.paged_attention(jnp.zeros(q_shape), jnp.zeros(pool_shape), jnp.zeros(pool_shape), rows=rows, pages=pages,
                            index=index, lengths=LENGTHS, q_positions=jnp.zeros(q_shape[:2], jnp.int32), **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(impl="flash"), "impl must be one of"),
    (dict(impl="pallas_tpu"), "'pallas_tpu' runs on a TPU, not on 'cpu'.*interpret=True.*use 'xla'"),
    (dict(impl="pallas_gpu"), "'pallas_gpu' runs on a GPU, not on 'cpu'.*interpret=True.*use 'xla'"),
    (dict(impl="pallas_gpu", interpret=True, q_shape=(5, 1, H, 24), pool_shape=(12, KV, S, 24)),
     r"head_dim a power of two >= 16, got 24"),
    (dict(impl="pallas_gpu", interpret=True, pool_shape=(12, KV, 8, D)),
     r"page size \(slots\) that is a power of two >= 16, got 8 \(k_pages \(12, 2, 8, 32\)\)"),
])
def test_bad_inputs_are_named(kw, match):
  with pytest.raises(ValueError, match=match):
    _call(**kw)
