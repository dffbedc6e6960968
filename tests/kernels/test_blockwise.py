"""Blockwise flash attention == naive reference, forward and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ptx_kernels as pk

SMALL = pk.BlockSizes(block_q=32, block_kv=16)

CASES = {
    "gqa4_causal": dict(h=8, kv=2, packed=False, kw=dict()),
    "gqa4_causal_packed": dict(h=4, kv=1, packed=True, kw=dict()),
    "gqa8_window_softcap_packed": dict(
        h=8, kv=1, packed=True, kw=dict(window=9, softcap=7.5)),
    "mha_noncausal_window_scale_packed": dict(
        h=2, kv=2, packed=True, kw=dict(causal=False, window=5, scale=0.3)),
}


def _segments_and_positions(helpers, b, t):
  seg = helpers.ragged_segments(3, b, t)
  # Positions restart at each document, as the packer writes them.
  pos = np.zeros((b, t), np.int32)
  s = np.asarray(seg)
  for r in range(b):
    for c in range(1, t):
      pos[r, c] = pos[r, c - 1] + 1 if s[r, c] == s[r, c - 1] else 0
  return dict(q_segment_ids=seg, kv_segment_ids=seg,
              q_positions=jnp.asarray(pos), kv_positions=jnp.asarray(pos))


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_f32(helpers, name):
  case = CASES[name]
  b, t, d = 2, 64, 16
  q, k, v = helpers.make_qkv(len(name), b, t, t, case["h"], case["kv"], d)
  kw = dict(case["kw"], **(_segments_and_positions(helpers, b, t) if case["packed"] else {}))
  helpers.assert_matches(
      functools.partial(pk.flash_attention, block_sizes=SMALL, **kw),
      functools.partial(pk.reference_attention, **kw), q, k, v)


def test_reference_matches_float64_numpy(helpers):
  q, k, v = helpers.make_qkv(0, 1, 20, 24, 4, 2, 8)
  qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = np.einsum("bthd,bshd->bhts", qn, np.repeat(kn, 2, axis=2)) / np.sqrt(8)
  logits = np.where(np.arange(24)[None, :] <= np.arange(20)[:, None], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  want = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True),
                   np.repeat(vn, 2, axis=2))
  out, _ = pk.reference_attention(q, k, v)
  # float32 against float64, the same math: a few ulps (6e-8 each) of the output's scale.
  assert helpers.rel_err(out, want) < 1e-6


def test_bf16_matches_reference(helpers):
  q, k, v = helpers.make_qkv(1, 2, 64, 64, 8, 1, 32, jnp.bfloat16)
  helpers.assert_matches(
      functools.partial(pk.flash_attention, block_sizes=SMALL, window=20),
      functools.partial(pk.reference_attention, window=20), q, k, v, tol=1e-2)  # bfloat16: see assert_matches


def test_rows_without_keys_are_zero_with_finite_grads(helpers):
  b, t = 1, 40
  q, k, v = helpers.make_qkv(2, b, t, t, 2, 1, 8)
  seg = jnp.asarray(np.r_[np.ones(20), np.zeros(20)][None].astype(np.int32))
  kv_seg = jnp.asarray(np.r_[np.zeros(10), np.ones(30)][None].astype(np.int32))
  # Query rows 0..9 see only keys 10.. in the future (causal): empty rows.
  kw = dict(q_segment_ids=seg, kv_segment_ids=kv_seg)
  out, lse, grads = helpers.assert_matches(
      functools.partial(pk.flash_attention, block_sizes=SMALL, **kw),
      functools.partial(pk.reference_attention, **kw), q, k, v)
  assert np.all(np.asarray(out)[0, :10] == 0) and np.all(np.asarray(out)[0, 20:] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[0, :, :10]))
  assert np.all(np.asarray(grads[0])[0, :10] == 0)


def test_traced_window_inside_scan_over_layers(helpers):
  q, k, v = helpers.make_qkv(4, 1, 48, 48, 4, 2, 8)
  windows = jnp.array([5, 2**30, 17], jnp.int32)

  def layers(q):
    def body(x, w):
      out, _ = pk.flash_attention(x, k, v, window=w, block_sizes=SMALL)
      return out, out
    return jax.lax.scan(body, q, windows)[1]

  got = jax.jit(layers)(q)
  x = q
  for i, w in enumerate([5, None, 17]):
    x, _ = pk.reference_attention(x, k, v, window=w)
    assert helpers.rel_err(got[i], x) < 1e-5  # tiled vs direct softmax sums, as in assert_matches
  jax.jit(jax.grad(lambda q: jnp.sum(layers(q))))(q)


def test_lengths_not_multiple_of_tiles_and_kv_longer_than_q(helpers):
  q, k, v = helpers.make_qkv(5, 1, 13, 50, 2, 1, 8)
  pos = dict(q_positions=jnp.arange(37, 50)[None], kv_positions=jnp.arange(50)[None])
  out, lse = pk.flash_attention(q, k, v, block_sizes=SMALL, **pos)
  ref_out, ref_lse = pk.reference_attention(q, k, v, **pos)
  assert out.shape == (1, 13, 2, 8) and lse.shape == (1, 2, 13)
  # Tiled vs direct softmax sums, as in assert_matches.
  assert helpers.rel_err(out, ref_out) < 1e-5
  assert helpers.rel_err(lse, ref_lse) < 1e-5


@pytest.mark.parametrize("bad, message", [
    (dict(k=jnp.zeros((1, 8, 3, 4)), v=jnp.zeros((1, 8, 3, 4))), "multiple of kv heads"),
    (dict(v=jnp.zeros((1, 9, 1, 4))), "differ"),
    (dict(q=jnp.zeros((8, 2, 4))), r"\[batch, seq, heads, head_dim\]"),
    (dict(q_segment_ids=jnp.ones((1, 8), jnp.int32)), "both"),
    (dict(q_positions=jnp.ones((1, 7), jnp.int32),
          kv_positions=jnp.ones((1, 8), jnp.int32)), r"shape \(1, 8\)"),
    (dict(window=0), "window"),
    (dict(window=jnp.ones(2, jnp.int32)), "window"),
    (dict(impl="cuda"), "impl"),
])
def test_invalid_inputs_raise(bad, message):
  args = dict(q=jnp.zeros((1, 8, 2, 4)), k=jnp.zeros((1, 8, 1, 4)),
              v=jnp.zeros((1, 8, 1, 4)))
  kwargs = {n: bad.pop(n) for n in list(bad) if n not in args}
  args.update(bad)
  with pytest.raises(ValueError, match=message):
    pk.flash_attention(args["q"], args["k"], args["v"], **kwargs)


def test_auto_is_blockwise_on_cpu(helpers):
  q, k, v = helpers.make_qkv(6, 1, 16, 16, 2, 1, 8)
  auto = pk.flash_attention(q, k, v, impl="auto")
  # Exact: "auto" picks the same blockwise program on CPU.
  np.testing.assert_array_equal(auto[0], pk.flash_attention(q, k, v)[0])


def test_block_sizes_are_validated():
  with pytest.raises(ValueError, match="power of two"):
    pk.BlockSizes(block_q=48)
  with pytest.raises(ValueError, match="power of two"):
    pk.BlockSizes(block_kv=0)
