"""Record kinds: decoding, validation and tokenization of SFT, preference and RL records.

Kinds and their fields:
  sft         `prompt` + `completion` (strings, completion non-empty), or
              `messages` (role/content list with a non-empty assistant turn;
              a content may be a list of text and image parts,
              `ptx.data.image_chat`, given an image config)
  preference  `prompt` (string or messages) + `chosen` + `rejected`
              (non-empty strings: the two assistant replies)
  rl          `prompt` (string or messages) + the task fields the
              environment needs (`answer`, `tests`, ...), passed through;
              messages are rendered once, here, through the chat template
              with the generation prompt; a string is encoded as written
              (bos + text, no template: an instruct model's prompts are
              written as messages)

Every problem with a record raises `RecordError` naming where the record came
from; the pipeline turns it into an exception or a counted skip. An example is
a dict of int32 arrays `tokens` and `loss_mask` (preference: one such dict per
reply under `chosen` and `rejected`; rl: plus the raw record under `task`;
sft with images: plus `image_slots` and `pixel_values`). An image that cannot
be read (a missing file, corrupt bytes, zero size) is a RecordError too.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import numpy as np

from ptx.data import image_chat
from ptx.data.batch import sft_example
from ptx.data.chat import ChatTemplate, encode_chat, validate_messages
from ptx.data.images import ImageConfig
from ptx.data.sources import RawRecord
from ptx.data.tokenizer import Tokenizer

KINDS = ("sft", "preference", "rl")


class RecordError(ValueError):
  """A record that cannot be used, with its location and the reason."""

  def __init__(self, where: str, reason: str):
    super().__init__(f"{where}: {reason}")
    self.where = where
    self.reason = reason


def decode(raw: RawRecord) -> dict[str, Any]:
  """Parses a raw record into a dict; raises RecordError on bad bytes or JSON."""
  obj = raw.payload
  if isinstance(obj, bytes):
    try:
      text = obj.decode("utf-8")
    except UnicodeDecodeError as e:
      raise RecordError(raw.where, f"invalid UTF-8 at byte {e.start}") from None
    try:
      obj = json.loads(text)
    except json.JSONDecodeError as e:
      raise RecordError(raw.where, f"malformed JSON: {e.msg} at column {e.colno}") from None
  if not isinstance(obj, dict):
    raise RecordError(raw.where, f"a record must be a JSON object, got {type(obj).__name__}")
  return obj


def encode(kind: str, tokenizer: Tokenizer, record: dict[str, Any], where: str,
           template: ChatTemplate | None = None, task_fields: Sequence[str] = (),
           images: ImageConfig | None = None) -> dict[str, Any]:
  """Validates and tokenizes one decoded record of `kind`.

  Args:
    kind: one of KINDS.
    tokenizer: any `Tokenizer`.
    record: the decoded record.
    where: its location, for errors.
    template: chat template for `messages` records (default: the
      tokenizer's, else ChatML).
    task_fields: fields an `rl` record must have.
    images: how `sft` conversations' images become tiles and tokens (None:
      records with image parts are refused).

  Returns:
    The example (see the module docstring).

  Raises:
    RecordError: on a missing, wrongly typed or empty field.
  """
  try:
    if kind == "sft" and image_chat.has_parts(record.get("messages")):
      return _image_chat_example(tokenizer, record, template, images)
    return _ENCODERS[kind](tokenizer, record, template, task_fields)
  except _FieldError as e:
    raise RecordError(where, str(e)) from None


class _FieldError(ValueError):
  """A field problem; `encode` adds the location."""


def _sft(tokenizer, record, template, task_fields) -> dict[str, np.ndarray]:
  del task_fields
  if "messages" in record:
    return _chat_example(tokenizer, _messages(record, "messages"), template)
  prompt = _text(record, "prompt")
  completion = _text(record, "completion", allow_empty=False)
  return sft_example(tokenizer, prompt, completion)


def _preference(tokenizer, record, template, task_fields) -> dict[str, dict[str, np.ndarray]]:
  del task_fields
  replies = {k: _text(record, k, allow_empty=False) for k in ("chosen", "rejected")}
  if isinstance(record.get("prompt"), list):
    messages = _messages(record, "prompt")
    return {k: _chat_example(tokenizer, messages + [{"role": "assistant", "content": v}], template)
            for k, v in replies.items()}
  prompt = _text(record, "prompt")
  return {k: sft_example(tokenizer, prompt, v) for k, v in replies.items()}


def _rl(tokenizer, record, template, task_fields) -> dict[str, Any]:
  for field in task_fields:
    if field not in record:
      raise _FieldError(f"missing field {field!r}")
  if isinstance(record.get("prompt"), list):
    ids, _ = encode_chat(tokenizer, _messages(record, "prompt"), template, add_generation_prompt=True)
  else:
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    ids = bos + tokenizer.encode(_text(record, "prompt", allow_empty=False))
  task = {k: v for k, v in record.items() if k != "prompt"}
  return {"tokens": np.asarray(ids, np.int32), "loss_mask": np.zeros(len(ids), np.int32), "task": task}


_ENCODERS: dict[str, Callable[..., dict[str, Any]]] = {"sft": _sft, "preference": _preference, "rl": _rl}


def _chat_example(tokenizer, messages, template) -> dict[str, np.ndarray]:
  ids, mask = encode_chat(tokenizer, messages, template)
  if not any(mask):
    raise _FieldError("conversation has no non-empty assistant turn to train on")
  return {"tokens": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.int32)}


def _image_chat_example(tokenizer, record, template, images) -> dict[str, np.ndarray]:
  if images is None:
    raise _FieldError("field 'messages' holds content parts, which need images on: data.tiles_per_row > 0 and a "
                      "model with a vision tower (model.vision.depth > 0)")
  try:
    image_chat.validate(record["messages"])
  except ValueError as e:
    raise _FieldError(str(e)) from None
  for i, m in enumerate(record["messages"]):
    parts = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
    for part in parts:
      if part["type"] == "text":
        _check_utf8(part["text"], f"messages[{i}].content")
  try:
    example = image_chat.encode(tokenizer, record["messages"], template, images)
  except ValueError as e:
    raise _FieldError(str(e)) from None
  if not example["loss_mask"].any():
    raise _FieldError("conversation has no non-empty assistant turn to train on")
  return example


def _messages(record: dict[str, Any], key: str) -> list[dict[str, Any]]:
  try:
    validate_messages(record[key])
  except ValueError as e:
    raise _FieldError(f"field {key!r}: {e}") from None
  for i, m in enumerate(record[key]):
    _check_utf8(m["content"], f"{key}[{i}].content")
  return record[key]


def _text(record: dict[str, Any], key: str, allow_empty: bool = True) -> str:
  if key not in record:
    raise _FieldError(f"missing field {key!r}")
  value = record[key]
  if not isinstance(value, str):
    raise _FieldError(f"field {key!r} must be a string, got {type(value).__name__}")
  if not allow_empty and not value.strip():
    raise _FieldError(f"field {key!r} is empty")
  _check_utf8(value, key)
  return value


def _check_utf8(text: str, key: str) -> None:
  # JSON escapes such as "\ud800" decode to lone surrogates: valid JSON, but
  # not text any tokenizer can encode.
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise _FieldError(f"field {key!r} is not valid UTF-8 (unpaired surrogate at {e.start})") from None
