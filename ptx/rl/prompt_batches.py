"""Prompt batches for GRPO's fused mode: left-padded prompts plus in-graph task targets.

Batch s holds tasks s * B .. (s + 1) * B - 1 of a random-access task source
(e.g. `ArithmeticTask`), so the iterator's state is one integer and a
checkpoint resumes the prompt stream exactly.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import grain
import numpy as np

from ptx.data.tokenizer import Tokenizer
from ptx.rl.token_rewards import encode_targets


class PromptBatches(grain.DatasetIterator):
  """Yields {"prompts" [B, P], "prompt_lengths" [B], "task": {"targets" [B, A]}} (numpy, int32).

  Args:
    tasks: random-access records with "prompt" and "answer" strings.
    tokenizer: encodes prompts (after bos) and answers (then eos).
    batch_size: prompts per batch (B).
    prompt_len: P; a longer prompt is an error naming its index.
    answer_width: A, answer tokens plus eos at most.
  """

  def __init__(self, tasks: Callable[[int], Mapping[str, Any]] | Any, tokenizer: Tokenizer, *, batch_size: int,
               prompt_len: int, answer_width: int):
    super().__init__()
    self._tasks, self._tokenizer = tasks, tokenizer
    self._batch_size, self._prompt_len, self._answer_width = batch_size, prompt_len, answer_width
    self._next = 0

  def __next__(self) -> dict[str, Any]:
    first = self._next * self._batch_size
    rows = [self._tasks[first + i] for i in range(self._batch_size)]
    self._next += 1
    prompts = np.full((self._batch_size, self._prompt_len), self._tokenizer.pad_id, np.int32)
    lengths = np.zeros(self._batch_size, np.int32)
    bos = [] if self._tokenizer.bos_id is None else [self._tokenizer.bos_id]
    for i, row in enumerate(rows):
      ids = bos + self._tokenizer.encode(row["prompt"])
      if len(ids) > self._prompt_len:
        raise ValueError(f"task {first + i}: prompt of {len(ids)} tokens exceeds prompt_len={self._prompt_len}")
      prompts[i, self._prompt_len - len(ids):] = ids
      lengths[i] = len(ids)
    targets = encode_targets(self._tokenizer, [r["answer"] for r in rows], self._answer_width)
    return {"prompts": prompts, "prompt_lengths": lengths, "task": {"targets": targets}}

  def get_state(self) -> dict[str, Any]:
    return {"next_batch": self._next}

  def set_state(self, state: dict[str, Any]) -> None:
    self._next = int(state["next_batch"])
