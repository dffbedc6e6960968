"""The shared visibility rule and the tile summaries kernels skip with."""

import jax.numpy as jnp
import numpy as np

from ptx_kernels import mask as mask_lib


def test_key_bounds_equal_the_visibility_rule():
  rng = np.random.default_rng(0)
  qp = jnp.asarray(rng.integers(0, 50, (2, 30)), jnp.int32)
  kp = jnp.asarray(rng.integers(0, 50, (2, 40)), jnp.int32)
  ones_q, ones_k = jnp.ones((2, 30), jnp.int32), jnp.ones((2, 40), jnp.int32)
  for causal in (True, False):
    for window in (None, 1, 7):
      mi = mask_lib.make_mask_inputs(2, 30, 40, q_positions=qp, kv_positions=kp,
                                     window=window)
      lo, hi = mask_lib.key_bounds(mi, causal)
      want = mask_lib.visible(ones_q, ones_k, qp, kp, causal=causal, window=mi.window)
      got = (kp[:, None, :] <= hi[:, :, None]) & (kp[:, None, :] > lo[:, :, None])
      np.testing.assert_array_equal(got, want)


def test_tile_summaries_never_skip_a_visible_pair():
  rng = np.random.default_rng(1)
  b, t, s, bq, bk = 2, 64, 96, 8, 16
  seg_q = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32)
  seg_k = jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), axis=1), jnp.int32)
  qp = jnp.asarray(rng.integers(0, 80, (b, t)), jnp.int32)
  kp = jnp.asarray(rng.integers(0, 80, (b, s)), jnp.int32)
  for causal, window in ((True, None), (True, 5), (False, 11)):
    mi = mask_lib.make_mask_inputs(
        b, t, s, q_segment_ids=seg_q, kv_segment_ids=seg_k, q_positions=qp,
        kv_positions=kp, window=window)
    lo, hi = mask_lib.key_bounds(mi, causal)
    qsum, kvsum = (np.asarray(x) for x in mask_lib.tile_summaries(mi, lo, hi, bq, bk))
    ok = np.asarray(mask_lib.visible(*mi[:4], causal=causal, window=mi.window))
    skipped = 0
    for r in range(b):
      for i in range(t // bq):
        for j in range(s // bk):
          may = bool(mask_lib.tiles_may_see(qsum[r, i], kvsum[r, j]))
          tile = ok[r, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
          assert may or not tile.any()
          skipped += not may
    assert skipped  # The test data leave some tiles to skip.
