"""Tile sizes shared by the blockwise and Pallas attention implementations."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Query and key/value tile lengths, validated on construction.

  Attributes:
    block_q: query rows per tile (forward and backward).
    block_kv: key/value rows per tile (forward and backward).

  A tile longer than the sequence is clamped to it; a sequence that is not a
  multiple of its tile is padded with segment id 0 (masked) and cropped back.
  """

  block_q: int = 512
  block_kv: int = 512

  def __post_init__(self):
    """Rejects tiles that are not positive powers of two."""
    for name in ("block_q", "block_kv"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a positive power of two, got {value!r}")

  def clamp(self, q_len: int, kv_len: int, minimum: int = 1) -> "BlockSizes":
    """Tiles no longer than the (power-of-two rounded) sequences, >= minimum."""
    up = lambda n: 1 << max(n - 1, 0).bit_length()
    fit = lambda block, n: max(min(block, up(n)), minimum)
    return BlockSizes(fit(self.block_q, q_len), fit(self.block_kv, kv_len))
