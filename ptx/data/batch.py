"""Tokenized examples and padded [batch, seq] training arrays.

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
  """Tokenizes `bos prompt completion eos`; only completion and eos are targets."""
  prompt_ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
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
  n = len(examples)
  batch = {
      "tokens": np.full((n, seq_len), pad_id, np.int32),
      "loss_mask": np.zeros((n, seq_len), np.int32),
      "segment_ids": np.zeros((n, seq_len), np.int32),
      "positions": np.zeros((n, seq_len), np.int32),
  }
  for row, ex in enumerate(examples):
    length = len(ex["tokens"])
    if length > seq_len:
      raise ValueError(f"example {row} has {length} tokens, more than seq_len={seq_len}")
    batch["tokens"][row, :length] = ex["tokens"]
    batch["loss_mask"][row, :length] = ex["loss_mask"]
    batch["segment_ids"][row, :length] = 1
    batch["positions"][row, :length] = np.arange(length)
  return batch
