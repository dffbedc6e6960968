"""Tokenized examples and padded or packed [batch, seq] training arrays.

A batch is a dict of int32 arrays of shape [B, T]:
  tokens       token ids (pad_id where padding)
  loss_mask    1 where the token is a training target, else 0
  segment_ids  1.. per packed sequence, 0 for padding
  positions    position of each token within its own sequence

Batches of a data stream with images (`ptx.data.image_chat`; `tiles_per_row`
N > 0) add, at N tiles per row whether or not its examples have images:
  image_slots           int32 [B, T]: the row's feature row of each image
                        token (its examples' tiles in order), -1 elsewhere
  pixel_values          float32 [B, N, 3, S, S]: the row's tiles, zero-padded
  pixel_attention_mask  int32 [B, N, S, S]: 1 on real tiles, 0 on padding
An example is one segment of its row, so its images' tokens and tiles stay
together. `PER_ROW` names the arrays laid out per row rather than per token.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ptx.data.images import pad_tiles
from ptx.data.tokenizer import Tokenizer

# Arrays of a batch laid out per row, not per token ([B, N, ...] tiles): `ptx.data.global_batch` shards their rows only.
PER_ROW = ("pixel_values", "pixel_attention_mask")


def sft_example(tokenizer: Tokenizer, prompt: str, completion: str) -> dict[str, np.ndarray]:
  """Tokenizes `bos prompt completion eos`; only completion and eos are targets.

  The bos token is left out for vocabularies without one.
  """
  bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
  prompt_ids = bos + tokenizer.encode(prompt)
  completion_ids = tokenizer.encode(completion) + [tokenizer.eos_id]
  return {
      "tokens": np.asarray(prompt_ids + completion_ids, np.int32),
      "loss_mask": np.asarray([0] * len(prompt_ids) + [1] * len(completion_ids), np.int32),
  }


def pad_batch(examples: Sequence[dict[str, np.ndarray]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """Right-pads one example per row to `seq_len`.

  Raises:
    ValueError: naming the example that is longer than `seq_len`.
  """
  return pack_rows([[ex] for ex in examples], seq_len, pad_id)


def pack_rows(rows: Sequence[Sequence[dict[str, np.ndarray]]], seq_len: int, pad_id: int, tiles_per_row: int = 0,
              tile_size: int = 0) -> dict[str, np.ndarray]:
  """Lays out each row's examples one after another, then pads to `seq_len`.

  Args:
    rows: per row, the examples packed into it (possibly none: an empty row).
    seq_len: T.
    pad_id: the token id written into padding.
    tiles_per_row: N, the image tiles of a row (0: text only).
    tile_size: S, the side of a tile in pixels (with `tiles_per_row`).

  Returns:
    The batch dict of int32 [len(rows), seq_len] arrays; the k-th example of
    a row has segment id k + 1 and positions 0..len-1. With `tiles_per_row`,
    also the arrays of the module docstring.

  Raises:
    ValueError: when a row's examples are longer than `seq_len` together, or
      have more than `tiles_per_row` tiles; examples with images and no
      `tiles_per_row`.
  """
  n = len(rows)
  batch = {
      "tokens": np.full((n, seq_len), pad_id, np.int32),
      "loss_mask": np.zeros((n, seq_len), np.int32),
      "segment_ids": np.zeros((n, seq_len), np.int32),
      "positions": np.zeros((n, seq_len), np.int32),
  }
  for r, row in enumerate(rows):
    start = 0
    for segment, ex in enumerate(row, 1):
      length = len(ex["tokens"])
      end = start + length
      if end > seq_len:
        what = f"example {r}" if len(row) == 1 else f"row {r}"
        raise ValueError(f"{what} has {end} tokens, more than seq_len={seq_len}")
      batch["tokens"][r, start:end] = ex["tokens"]
      batch["loss_mask"][r, start:end] = ex["loss_mask"]
      batch["segment_ids"][r, start:end] = segment
      batch["positions"][r, start:end] = np.arange(length)
      start = end
  if tiles_per_row:
    if tile_size < 1:
      raise ValueError(f"tiles_per_row={tiles_per_row} needs the tiles' tile_size, got {tile_size}")
    batch.update(_image_rows(rows, seq_len, tiles_per_row, tile_size))
  elif any("pixel_values" in ex for row in rows for ex in row):
    raise ValueError("examples with images need tiles_per_row, the static tile count of a row")
  return batch


def _image_rows(rows, seq_len: int, tiles_per_row: int, tile_size: int) -> dict[str, np.ndarray]:
  """The image arrays of `pack_rows`: each example's slots moved past the image tokens before it in its row."""
  slots = np.full((len(rows), seq_len), -1, np.int32)
  pixels, masks = [], []
  for r, row in enumerate(rows):
    start, before = 0, 0
    for ex in row:
      length = len(ex["tokens"])
      own = ex.get("image_slots", np.full(length, -1, np.int32))
      slots[r, start:start + length] = np.where(own >= 0, own + before, -1)
      before += int((own >= 0).sum())
      start += length
    tiles = [ex["pixel_values"] for ex in row if "pixel_values" in ex] or [np.zeros((0, 3, tile_size, tile_size))]
    try:
      row_pixels, row_mask = pad_tiles(tiles, tiles_per_row)
    except ValueError as e:
      raise ValueError(f"row {r}: {e}") from None
    pixels.append(row_pixels)
    masks.append(row_mask)
  return {"image_slots": slots, "pixel_values": np.stack(pixels), "pixel_attention_mask": np.stack(masks)}
