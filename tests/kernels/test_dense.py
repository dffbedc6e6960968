"""The fast materialised attention == the naive reference, forward and gradients."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import ptx_kernels as pk
from test_blockwise import CASES, _segments_and_positions


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_f32(helpers, name):
  case = CASES[name]
  b, t, d = 2, 64, 16
  q, k, v = helpers.make_qkv(len(name), b, t, t, case["h"], case["kv"], d)
  kw = dict(case["kw"], **(_segments_and_positions(helpers, b, t) if case["packed"] else {}))
  helpers.assert_matches(functools.partial(pk.dense_attention, **kw),
                         functools.partial(pk.reference_attention, **kw), q, k, v)


def test_bf16_matches_reference(helpers):
  q, k, v = helpers.make_qkv(1, 2, 64, 64, 8, 1, 32, jnp.bfloat16)
  helpers.assert_matches(functools.partial(pk.dense_attention, window=20),
                         functools.partial(pk.reference_attention, window=20), q, k, v,
                         tol=1e-2)  # bfloat16: see assert_matches


def test_rows_without_keys_are_zero_with_finite_grads(helpers):
  q, k, v = helpers.make_qkv(2, 1, 40, 40, 2, 1, 8)
  seg = jnp.asarray(np.r_[np.ones(20), np.zeros(20)][None].astype(np.int32))
  kv_seg = jnp.asarray(np.r_[np.zeros(10), np.ones(30)][None].astype(np.int32))
  kw = dict(q_segment_ids=seg, kv_segment_ids=kv_seg)
  out, lse, grads = helpers.assert_matches(functools.partial(pk.dense_attention, **kw),
                                           functools.partial(pk.reference_attention, **kw), q, k, v)
  assert np.all(np.asarray(out)[0, :10] == 0) and np.all(np.isneginf(np.asarray(lse)[0, :, :10]))
  assert np.all(np.isfinite(np.asarray(grads[0])))
