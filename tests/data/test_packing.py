"""First-fit bin pool: density, closing rules and state."""

import numpy as np
import pytest

from ptx.data.packing import BinPool


def _pack_all(pool, lengths):
  rows = [row for key, n in enumerate(lengths) if (row := pool.add(key, int(n))) is not None]
  return rows + pool.drain()


def test_at_least_95_percent_full_at_2048_on_records_of_50_to_1500_tokens():
  lengths = np.random.default_rng(0).integers(50, 1501, 3000)
  rows = _pack_all(BinPool(2048, 64), lengths)
  assert sorted(k for row in rows for k in row) == list(range(3000))
  assert all(sum(lengths[k] for k in row) <= 2048 for row in rows)
  assert lengths.sum() / (len(rows) * 2048) >= 0.95


def test_exactly_full_row_closes_at_once_and_fullest_row_makes_room():
  pool = BinPool(10, 2)
  assert pool.add(0, 6) is None and pool.add(1, 7) is None
  assert pool.add(2, 4) == [0, 2]  # fills row 0 exactly
  assert pool.add(3, 5) is None
  assert pool.add(4, 6) == [1]  # no room anywhere: the fullest row (7) leaves
  assert pool.drain() == [[4], [3]]


def test_state_round_trips():
  pool = BinPool(16, 3)
  for key, n in enumerate([5, 9, 3, 12]):
    pool.add(key, n)
  other = BinPool(16, 3)
  other.set_state(pool.get_state())
  assert other.keys() == pool.keys() and other.add(9, 2) == pool.add(9, 2) and other.drain() == pool.drain()


def test_rejects_sequences_that_cannot_fit():
  with pytest.raises(ValueError, match="outside 1..8"):
    BinPool(8, 2).add(0, 9)


def test_a_row_holds_at_most_tiles_per_row_image_tiles():
  pool = BinPool(20, 2, tiles_per_row=3)
  assert pool.add(0, 4, tiles=2) is None
  assert pool.add(1, 4, tiles=2) is None  # room for its tokens in row 0, not for its tiles: a second row
  assert pool.add(2, 4, tiles=1) is None and pool.add(3, 4) is None  # row 0 takes 1 tile more, then text
  assert pool.add(4, 5, tiles=3) == [0, 2, 3]  # no row has 3 tiles free: the fullest row leaves
  restored = BinPool(20, 2, tiles_per_row=3)
  restored.set_state(pool.get_state())
  assert restored.add(5, 1, tiles=1) is None and pool.add(5, 1, tiles=1) is None  # row 1 takes its last tile
  assert restored.drain() == pool.drain() == [[1, 5], [4]]
  assert pool.drain() == [] and BinPool(20, 2, tiles_per_row=3).add(6, 1, tiles=2) is None
  with pytest.raises(ValueError, match="4 image tiles, outside 0..3"):
    pool.add(7, 1, tiles=4)
