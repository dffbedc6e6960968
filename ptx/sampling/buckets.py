"""Shape buckets: pad ragged host inputs to a few shapes so few programs compile.

The batch, the prompt length, the generation budget and the number of stop
ids are each rounded up to a power of two (with a floor), so a stream of
requests of every size compiles about log2(range) programs per dimension.
Prompts are left-padded: every prompt ends at the last column, so the first
generated token of every row goes to the same cache slot.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def bucket(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum)."""
  n = max(int(n), int(minimum), 1)
  return 1 << (n - 1).bit_length()


def left_pad(prompts: Sequence[Sequence[int]], n_rows: int, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads ragged prompts into int32 [n_rows, length], with their lengths [n_rows].

  Rows past `len(prompts)` are filler prompts of one `pad_id` token (their
  outputs are dropped).

  Raises:
    ValueError: for an empty prompt or one longer than `length`.
  """
  tokens = np.full((n_rows, length), pad_id, np.int32)
  lengths = np.ones((n_rows,), np.int32)
  for row, prompt in enumerate(prompts):
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    if not 0 < prompt.size <= length:
      raise ValueError(f"prompt {row} has {prompt.size} tokens; need 1..{length}")
    tokens[row, length - prompt.size:] = prompt
    lengths[row] = prompt.size
  return tokens, lengths


def stop_table(stop_ids: Sequence[int] | Sequence[Sequence[int]], n_prompts: int, n_rows: int) -> np.ndarray:
  """Per-row stop ids as int32 [n_rows, K] padded with -1 (never a token), K a bucket.

  Args:
    stop_ids: ids shared by every prompt, or one sequence of ids per prompt.
    n_prompts: the number of real prompts.
    n_rows: the padded batch.
  """
  shared = len(stop_ids) == 0 or np.isscalar(stop_ids[0])
  per_prompt = [list(stop_ids)] * n_prompts if shared else [list(ids) for ids in stop_ids]
  if len(per_prompt) != n_prompts:
    raise ValueError(f"stop_ids: {len(per_prompt)} lists for {n_prompts} prompts")
  table = np.full((n_rows, bucket(max([len(s) for s in per_prompt] + [1]))), -1, np.int32)
  for row, ids in enumerate(per_prompt):
    table[row, :len(ids)] = ids
  return table
