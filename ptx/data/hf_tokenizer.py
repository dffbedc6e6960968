"""HF `tokenizers` adapter and the loader for HF model directories.

`load_tokenizer(dir)` reads what transformers reads: `tokenizer.json` (or a
SentencePiece `tokenizer.model` where there is none), the special tokens of
`tokenizer_config.json`, and the chat template from `chat_template.jinja` or
`tokenizer_config.json`. The `tokenizers` package (a dependency) and
`jinja2` (the `hf` extra, for chat templates) are imported only when used.
Directories are local or gs:// (`ptx.paths`): files are read and written
whole, through the path type.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from ptx import paths
from ptx.data.chat import JinjaChatTemplate


class HFTokenizer:
  """A `tokenizers.Tokenizer` behind the ptx `Tokenizer` protocol.

  Args:
    tokenizer: a `tokenizers.Tokenizer`.
    eos_token: the end-of-sequence token text (must be in the vocabulary).
    bos_token: the begin-of-sequence token text, or None where there is none.
    pad_token: the padding token text; None pads with eos.
    chat_template: an optional `ChatTemplate` for chat records.
  """

  def __init__(self, tokenizer: Any, *, eos_token: str, bos_token: str | None = None,
               pad_token: str | None = None, chat_template: Any = None):
    self._tok = tokenizer
    self._eos = self._id(eos_token)
    self._bos = None if bos_token is None else self._id(bos_token)
    self._pad = self._eos if pad_token is None else self._id(pad_token)
    self.chat_template = chat_template

  @classmethod
  def from_file(cls, path: str | os.PathLike, **kwargs: Any) -> "HFTokenizer":
    """Loads a `tokenizer.json` (local or gs://); keyword arguments as for the constructor."""
    import tokenizers  # a dependency, imported only where a tokenizer is read or written

    return cls(tokenizers.Tokenizer.from_str(paths.path(path).read_text()), **kwargs)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def bos_id(self) -> int | None:
    return self._bos

  @property
  def eos_id(self) -> int:
    return self._eos

  def encode(self, text: str) -> list[int]:
    # Special tokens written in the text (a chat template's <|im_start|>) still
    # map to their ids; only the post-processor's bos/eos are left out.
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def save_hf(self, path: str | os.PathLike) -> None:
    """Writes `tokenizer.json` and `tokenizer_config.json` (special tokens, chat template) into directory `path`."""
    path = paths.path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(self._tok.to_str(pretty=True))  # as `Tokenizer.save` writes it
    text = self._tok.id_to_token
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": text(self._eos), "pad_token": text(self._pad),
              "bos_token": None if self._bos is None else text(self._bos)}
    if isinstance(self.chat_template, JinjaChatTemplate):
      config["chat_template"] = self.chat_template.source
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

  def _id(self, token: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise ValueError(f"special token {token!r} is not in the tokenizer's vocabulary")
    return i


def load_tokenizer(path: str | os.PathLike):
  """Loads the tokenizer of an HF model directory.

  Args:
    path: a directory, local or gs://, with `tokenizer.json` or
      `tokenizer.model`, and usually `tokenizer_config.json`.

  Returns:
    An `HFTokenizer` (or a `SentencePieceTokenizer`) with the model's special
    tokens and its chat template, if it has one.

  Raises:
    FileNotFoundError: when the directory holds no tokenizer file.
    ValueError: when a special token is not in the vocabulary.
  """
  path = paths.path(path)
  config_file = path / "tokenizer_config.json"
  config = json.loads(config_file.read_text()) if config_file.exists() else {}
  bos, eos, pad = (_token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token"))
  template = _chat_template(path, config)
  chat = None if template is None else JinjaChatTemplate(template, bos or "", eos or "")
  if config.get("add_bos_token") is False:
    # transformers never prepends it (SmolLM2 names <|im_start|> its bos_token, which only its template writes).
    bos = None
  if (path / "tokenizer.json").exists():
    if eos is None:
      raise ValueError(f"{config_file}: no eos_token; ptx needs one to end sequences")
    return HFTokenizer.from_file(path / "tokenizer.json", eos_token=eos, bos_token=bos,
                                 pad_token=pad, chat_template=chat)
  if (path / "tokenizer.model").exists():
    from ptx.data.sentencepiece_tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer(model_proto=(path / "tokenizer.model").read_bytes(), chat_template=chat)
  raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer.model")


def _token_text(value: Any) -> str | None:
  """Special tokens are strings or AddedToken dicts in tokenizer_config.json."""
  return value.get("content") if isinstance(value, dict) else value


def _chat_template(path: paths.Path, config: dict) -> str | None:
  jinja_file = path / "chat_template.jinja"
  if jinja_file.exists():
    return jinja_file.read_text()
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates; "default" is the chat one
    template = {t["name"]: t["template"] for t in template}.get("default")
  return template
