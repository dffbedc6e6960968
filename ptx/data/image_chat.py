"""Chat conversations with images (Idefics3 / SmolVLM): parts checked, images tiled, image tokens expanded.

A message's content is a string or a non-empty list of parts:

  {"type": "text", "text": "..."}
  {"type": "image", "path": "..."}        an image file, absolute or relative to the working directory
  {"type": "image", "bytes": "<base64>"}  the image file itself, base64-encoded

The chat template renders each image part as the `<image>` placeholder: ptx's ChatML as `ChatMLTemplate.image_text`,
an HF template (SmolVLM's) from the parts themselves, each image reduced to `{"type": "image"}` as transformers
passes it. Image i of the conversation (parts in order) replaces the i-th placeholder of the rendering by its
expansion (`ptx.data.image_tokens`), so the ids equal transformers' processor's on the same rendering. An image's
tokens are never targets, even inside an assistant turn.

The example: int32 `tokens`, `loss_mask` and `image_slots` [T] (`ptx.data.image_tokens.image_slots`) and float32
`pixel_values` [tiles, 3, S, S], every image's tiles in order (`ptx.data.images.tile`), one feature row block of
`image_seq_len` rows per tile. Problems are ValueErrors naming the part (`messages[0].content[1].path: ...`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Sequence

import numpy as np

from ptx.data import image_tokens
from ptx.data.chat import ChatTemplate, encode_chat, validate_messages
from ptx.data.images import ImageConfig, Tiles, load, tile
from ptx.data.tokenizer import Tokenizer


def has_parts(messages: Any) -> bool:
  """Whether any message's content is a list of parts (the conversation may hold images)."""
  return isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                            for m in messages)


def validate(messages: Any) -> None:
  """Raises ValueError unless `messages` is a conversation whose contents are strings or lists of parts."""
  validate_messages([{**m, "content": ""} if isinstance(m, dict) and isinstance(m.get("content"), list) else m
                     for m in messages] if isinstance(messages, list) else messages)
  for i, m in enumerate(messages):
    if isinstance(m["content"], str):
      continue
    if not m["content"]:
      raise ValueError(f"messages[{i}].content is an empty list of parts")
    for j, part in enumerate(m["content"]):
      where = f"messages[{i}].content[{j}]"
      if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
        raise ValueError(f"{where} must be an object of type 'text' or 'image'")
      if part["type"] == "text" and not isinstance(part.get("text"), str):
        raise ValueError(f"{where}.text must be a string, got {type(part.get('text')).__name__}")
      sources = [k for k in ("path", "bytes") if k in part]
      if part["type"] == "image" and (len(sources) != 1 or not isinstance(part[sources[0]], str)):
        raise ValueError(f"{where}: an image part needs one string field, 'path' or 'bytes' (base64)")


def encode(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], template: ChatTemplate | None,
           cfg: ImageConfig) -> dict[str, np.ndarray]:
  """Tiles the images of a checked conversation and encodes it with their tokens.

  Args:
    tokenizer: a tokenizer holding the family's image tokens.
    messages: the conversation, checked by `validate`.
    template: as for `ptx.data.chat.encode_chat`.
    cfg: how images become tiles and tokens.

  Returns:
    The example of the module docstring.

  Raises:
    ValueError: an image that cannot be read, a tokenizer without the image
      tokens, or a rendering whose placeholders do not match the images.
  """
  tiles = [_tiles(part, f"messages[{i}].content[{j}]", cfg) for i, m in enumerate(messages)
           if isinstance(m["content"], list) for j, part in enumerate(m["content"]) if part["type"] == "image"]
  expansions = [image_tokens.encode_expansion(tokenizer, t.rows, t.cols, cfg.image_seq_len) for t in tiles]
  placed = 0

  def encode_text(text: str) -> tuple[list[int], list[int]]:
    nonlocal placed
    pieces = text.split(image_tokens.IMAGE)
    ids = tokenizer.encode(pieces[0])
    trainable = [1] * len(ids)
    for piece in pieces[1:]:
      if placed == len(expansions):
        raise ValueError(f"messages: the rendering holds more {image_tokens.IMAGE} placeholders than the "
                         f"{len(expansions)} image parts (is {image_tokens.IMAGE} written in a text part?)")
      after = tokenizer.encode(piece)
      ids += expansions[placed] + after
      trainable += [0] * len(expansions[placed]) + [1] * len(after)
      placed += 1
    return ids, trainable

  rendered = [{**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
              if isinstance(m["content"], list) else m for m in messages]
  ids, mask = encode_chat(tokenizer, rendered, template, encode_text=encode_text)
  if placed != len(expansions):
    raise ValueError(f"messages: the chat template rendered {placed} of the {len(expansions)} image parts")
  tokens = np.asarray(ids, np.int32)
  if not tiles:  # parts of text alone
    return {"tokens": tokens, "loss_mask": np.asarray(mask, np.int32), "image_slots": np.full(len(ids), -1, np.int32),
            "pixel_values": np.zeros((0, 3, cfg.tile_size, cfg.tile_size), np.float32)}
  return {"tokens": tokens, "loss_mask": np.asarray(mask, np.int32),
          "image_slots": image_tokens.image_slots(tokens, image_tokens.image_token_id(tokenizer)),
          "pixel_values": np.concatenate([t.pixel_values for t in tiles])}


def _tiles(part: dict[str, Any], where: str, cfg: ImageConfig) -> Tiles:
  if "path" in part:
    try:
      image = load(part["path"])
    except FileNotFoundError:
      raise ValueError(f"{where}.path: no such file {part['path']!r}") from None
    except (OSError, ValueError) as e:
      raise ValueError(f"{where}.path {part['path']!r}: {e}") from None
  else:
    try:
      data = base64.b64decode(part["bytes"], validate=True)
    except binascii.Error as e:
      raise ValueError(f"{where}.bytes is not base64: {e}") from None
    try:
      image = load(data)
    except ValueError as e:
      raise ValueError(f"{where}.bytes: {e}") from None
  return tile(image, cfg)
