"""The tokenizer protocol and the dependency-free byte-level tokenizer.

Every pipeline in ptx takes any object with this protocol; the byte tokenizer
is the default for tests and the tiny presets.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
  """What ptx needs from a tokenizer."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def bos_id(self) -> int: ...

  @property
  def eos_id(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes as tokens: ids 0..2 are pad, bos, eos; byte b is id b + 3."""

  OFFSET = 3

  @property
  def vocab_size(self) -> int:
    return 256 + self.OFFSET

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  def encode(self, text: str) -> list[int]:
    return [b + self.OFFSET for b in text.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
    return data.decode("utf-8", errors="replace")
