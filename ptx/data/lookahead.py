"""An iterator a consumer may read ahead of and still checkpoint exactly: GRPO's host-reward, engine and episode
steps peek the prompt batches they sample (or prepare) ahead of the one they train on."""

from __future__ import annotations

import collections
from typing import Any

import grain


class Lookahead(grain.DatasetIterator):
  """A resumable iterator a consumer may read ahead of; its state is that of the next item `next` returns.

  Args:
    iterator: an iterator with get_state/set_state (e.g. `PromptBatches`).
  """

  def __init__(self, iterator: Any):
    super().__init__()
    self._iterator = iterator
    self._buffer: collections.deque = collections.deque()  # (state before the item, item)

  @classmethod
  def of(cls, data: Any) -> Lookahead:
    """`data` as a Lookahead: itself when it is one already (a step kind's `stream`, called again on resume)."""
    return data if isinstance(data, Lookahead) else cls(data)

  def __next__(self) -> Any:
    return self._buffer.popleft()[1] if self._buffer else next(self._iterator)

  def peek(self, i: int) -> Any:
    """The item `i` places after the next one `next` returns (0: the next)."""
    while len(self._buffer) <= i:
      state = self._iterator.get_state()
      self._buffer.append((state, next(self._iterator)))
    return self._buffer[i][1]

  def skip(self) -> None:
    """Consumes the next item without returning it (a refill took it)."""
    self.peek(0)
    self._buffer.popleft()

  def get_state(self) -> Any:
    return self._buffer[0][0] if self._buffer else self._iterator.get_state()

  def set_state(self, state: Any) -> None:
    self._buffer.clear()
    self._iterator.set_state(state)
