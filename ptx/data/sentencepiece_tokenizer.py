"""SentencePiece adapter behind the ptx `Tokenizer` protocol.

The `sentencepiece` package is imported only when a model is loaded.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence


class SentencePieceTokenizer:
  """A SentencePiece model (`tokenizer.model`) as a ptx tokenizer.

  Args:
    model_file: path of the serialized model; or
    model_proto: its bytes.
    chat_template: an optional `ChatTemplate` for chat records.

  Raises:
    ValueError: when the model has no eos piece.
  """

  def __init__(self, model_file: str | pathlib.Path | None = None, *, model_proto: bytes | None = None,
               chat_template: Any = None):
    import sentencepiece  # the tokenizers extra

    if (model_file is None) == (model_proto is None):
      raise ValueError("SentencePieceTokenizer needs exactly one of model_file and model_proto")
    if model_file is not None:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    else:
      self._sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    if self._sp.eos_id() < 0:
      raise ValueError("SentencePiece model has no eos piece; ptx needs one to end sequences")
    self.chat_template = chat_template

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def pad_id(self) -> int:
    # SentencePiece disables pad by default (id -1); padding is masked anyway.
    return self._sp.pad_id() if self._sp.pad_id() >= 0 else self._sp.eos_id()

  @property
  def bos_id(self) -> int | None:
    return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode([int(i) for i in ids])
