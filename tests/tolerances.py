"""Numeric settings shared by the equivalence tests, each with the source of its size.

Two programs that compute the same float32 math (fused vs unfused, sharded vs
single device, host vs in-graph rewards, micro-batched vs whole) sum in
another order, so their results differ in the last bits: about 1e-7 relative
per operation, ~1e-6 after a few layers. The tests say so beside each
tolerance; this module holds what several files share.
"""

import numpy as np

# Adam's epsilon for tests that compare parameters after optimizer steps of two different programs.
# Adam's first update is lr * g / (|g| + eps). Its slope in g is at most lr / eps, at g = 0: with the default
# eps = 1e-8 a gradient entry that happens to lie near 0 turns a last-bit difference d ~ 1e-10 between the two
# programs into moves lr * d / eps = 1% of lr apart (seen: 3.6e-6 at lr 1e-3 in test_rl_step, 98% of a 1e-5 tolerance
# in test_step), and every other entry moves by lr * sign(g), so the parameters check only the gradients' signs.
# With eps = 1e-3 the slope is at most lr / eps <= 10 for the tests' lr <= 1e-2: the updates differ by at most that
# many times the gradients' ~1e-9, and each entry still moves in proportion to its gradient (lr / 2 at |g| = eps).
ADAM_EPS = 1e-3


def assert_close_to_scale(got, want, rel: float) -> None:
  """|got - want| <= rel * (|want| + max |want|): relative to each value and to the array's scale.

  A float32 sum in another order errs relative to its summands, not to its result: an entry that is the cancellation
  of larger terms (a gradient near 0) can be off by 100% of itself. The array's largest entry stands for the
  summands' scale, so pass one array (one gradient leaf) at a time.
  """
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_allclose(got, want, rtol=rel, atol=rel * float(np.abs(want).max()))
