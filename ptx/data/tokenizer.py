"""The tokenizer protocol and the dependency-free byte-level tokenizer.

Every pipeline in ptx takes any object with this protocol; the byte tokenizer
is the default for tests and the tiny presets. `encode` never adds special
tokens: callers add `bos_id`/`eos_id` (or a chat template renders them), so
one text always has one encoding. A tokenizer may carry a chat template in a
`chat_template` attribute (see `ptx.data.chat`); where it has none, chat
records use the built-in ChatML template.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
  """What ptx needs from a tokenizer.

  `bos_id` may be None for vocabularies without a begin-of-sequence token
  (Qwen); `pad_id` is always an id, borrowed from eos where the vocabulary
  has no pad token (padding is masked by segment id 0, never trained on).
  """

  @property
  def vocab_size(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def bos_id(self) -> int | None: ...

  @property
  def eos_id(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes as tokens: ids 0..2 are pad, bos, eos; byte b is id b + 3.

  Args:
    chat_template: an optional `ptx.data.chat.ChatTemplate` for chat records.
  """

  OFFSET = 3

  def __init__(self, chat_template=None):
    self.chat_template = chat_template

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
