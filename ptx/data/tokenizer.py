"""The tokenizer protocol and the dependency-free byte-level tokenizer.

Every pipeline in ptx takes any object with this protocol; the byte tokenizer
is the default for tests and the tiny presets. `encode` never adds special
tokens: callers add `bos_id`/`eos_id` (or a chat template renders them), so
one text always has one encoding. A tokenizer may carry a chat template in a
`chat_template` attribute (see `ptx.data.chat`); where it has none, chat
records use the built-in ChatML template.

`check_fits(tokenizer, vocab_size, where)` is the one check, wherever a
tokenizer meets a model, that every id it can produce has an embedding
row: a model vocabulary larger than the tokenizer's is normal (padded
embeddings), a smaller one is an error.
"""

from __future__ import annotations

import json
import os
from typing import Protocol, Sequence, runtime_checkable

from ptx import paths


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


def check_fits(tokenizer: Tokenizer, vocab_size: int, where: str) -> None:
  """Refuses a tokenizer with ids the model has no embedding for.

  Args:
    tokenizer: the tokenizer that feeds the model.
    vocab_size: the model's vocabulary (`ModelConfig.vocab_size`).
    where: what the two come from, for the message.

  Raises:
    ValueError: when the tokenizer's vocabulary is larger than the model's.
  """
  if tokenizer.vocab_size > vocab_size:
    raise ValueError(f"{where}: tokenizer vocab {tokenizer.vocab_size} > model vocab_size {vocab_size}: ids "
                     f"{vocab_size}..{tokenizer.vocab_size - 1} have no embedding; use the model's own tokenizer "
                     "or a model with a vocabulary at least as large")


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

  def save_hf(self, path: str | os.PathLike) -> None:
    """Writes this vocabulary as HF `tokenizer.json` + `tokenizer_config.json` in directory `path`.

    The file is a byte-level BPE without merges: every byte is its own token
    with id b + 3, so `load_tokenizer(path)` and transformers' `AutoTokenizer`
    encode every text exactly as this class does (`add_special_tokens=False`;
    with special tokens transformers prepends bos, as ptx's callers do).
    """
    import tokenizers  # a dependency, imported only where a tokenizer is read or written
    from tokenizers import decoders, models, pre_tokenizers, processors

    specials = ["<pad>", "<s>", "</s>"]
    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # GPT-2's printable stand-ins for the 256 bytes
    to_char = _gpt2_byte_chars()
    assert set(to_char) == set(byte_chars)
    vocab = {**{t: i for i, t in enumerate(specials)}, **{c: b + self.OFFSET for b, c in enumerate(to_char)}}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials])
    # ptx models see bos first: transformers' add_special_tokens=True prepends it too.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    path = paths.path(path)  # local or gs://
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tok.to_str(pretty=True))  # as `Tokenizer.save` writes it
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>",
              "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False,
              "model_max_length": 1_000_000_000}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _gpt2_byte_chars() -> list[str]:
  """GPT-2's byte-to-unicode table: entry b is the printable character standing for byte b."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  chars, extra = [], 0
  for b in range(256):
    if b in printable:
      chars.append(chr(b))
    else:
      chars.append(chr(256 + extra))
      extra += 1
  return chars
