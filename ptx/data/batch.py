"""Tokenized examples and padded or packed [batch, seq] training arrays.

A batch is a dict of int32 arrays of shape [B, T]:
  tokens       token ids (pad_id where padding)
  loss_mask    1 where the token is a training target, else 0
  segment_ids  1.. per packed sequence, 0 for padding
  positions    position of each token within its own sequence
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ptx.data.tokenizer import Tokenizer


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


def pack_rows(
    rows: Sequence[Sequence[dict[str, np.ndarray]]], seq_len: int, pad_id: int
) -> dict[str, np.ndarray]:
  """Lays out each row's examples one after another, then pads to `seq_len`.

  Args:
    rows: per row, the examples packed into it (possibly none: an empty row).
    seq_len: T.
    pad_id: the token id written into padding.

  Returns:
    The batch dict of int32 [len(rows), seq_len] arrays; the k-th example of
    a row has segment id k + 1 and positions 0..len-1.

  Raises:
    ValueError: when a row's examples are longer than `seq_len` together.
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
  return batch
