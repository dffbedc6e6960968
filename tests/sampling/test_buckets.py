"""Shape buckets: powers of two, left padding, per-row stop tables."""

import numpy as np
import pytest

from ptx.sampling.buckets import bucket, left_pad, stop_table


def test_bucket_is_the_next_power_of_two_above_a_floor():
  assert [bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
  assert bucket(3, minimum=8) == 8


def test_left_pad_right_aligns_prompts_and_fills_rows():
  tokens, lengths = left_pad([[1, 2], [3]], n_rows=3, length=4, pad_id=0)
  np.testing.assert_array_equal(tokens, [[0, 0, 1, 2], [0, 0, 0, 3], [0, 0, 0, 0]])
  np.testing.assert_array_equal(lengths, [2, 1, 1])
  with pytest.raises(ValueError):
    left_pad([[]], n_rows=1, length=4, pad_id=0)
  with pytest.raises(ValueError):
    left_pad([[1] * 5], n_rows=1, length=4, pad_id=0)


def test_stop_table_shared_per_prompt_and_empty():
  np.testing.assert_array_equal(stop_table(np.array([3, 4, 5]), 1, 2), [[3, 4, 5, -1], [-1, -1, -1, -1]])
  np.testing.assert_array_equal(stop_table([[1], [2, 3]], 2, 2), [[1, -1], [2, 3]])
  np.testing.assert_array_equal(stop_table((), 2, 2), [[-1], [-1]])
  with pytest.raises(ValueError):
    stop_table([[1], [2]], 3, 4)
