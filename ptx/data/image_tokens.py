"""Image tokens of the Idefics3 / SmolVLM family: one image's expansion in the prompt, and its features' slots.

A chat rendering holds one `<image>` placeholder per image. transformers' `Idefics3Processor` and `SmolVLMProcessor`
replace the i-th placeholder by the expansion of image i, built from its tile grid (`ptx.data.images.Tiles`):

  rows = cols = 0:  <fake_token_around_image><global-img><image>*n<fake_token_around_image>
  else, per row r:  (<fake_token_around_image><row_r_col_c><image>*n for each column c) + "\\n"
        then:       "\\n<fake_token_around_image><global-img><image>*n<fake_token_around_image>"

with n = `image_seq_len` tokens per tile. Each `<image>` token takes one feature row of the vision encoder's output
for its tile, in the order of the tiles (`Tiles.pixel_values`: row-major tiles, then the global image), so
`image_slots` of a token row is the running count of `<image>` tokens: the flattened feature row each one reads,
-1 elsewhere, and the model merges features at static shapes.
"""

from __future__ import annotations

import numpy as np

from ptx.data.tokenizer import Tokenizer

IMAGE = "<image>"
FAKE_AROUND_IMAGE = "<fake_token_around_image>"
GLOBAL_IMAGE = "<global-img>"


def expansion(rows: int, cols: int, image_seq_len: int) -> str:
  """The prompt text that replaces one image's placeholder.

  Args:
    rows: tile rows of the image (0 with `cols` 0: the image is one tile).
    cols: tile columns.
    image_seq_len: `<image>` tokens per tile.

  Returns:
    The text, as transformers' processors build it.
  """
  tokens = IMAGE * image_seq_len
  whole = f"{FAKE_AROUND_IMAGE}{GLOBAL_IMAGE}{tokens}{FAKE_AROUND_IMAGE}"
  if rows == 0 and cols == 0:
    return whole
  grid = "".join("".join(f"{FAKE_AROUND_IMAGE}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
                 for r in range(rows))
  return f"{grid}\n{whole}"


def image_token_id(tokenizer: Tokenizer) -> int:
  """The id of `<image>`; raises ValueError unless the tokenizer encodes it as one token."""
  ids = tokenizer.encode(IMAGE)
  if len(ids) != 1:
    raise ValueError(f"the tokenizer encodes {IMAGE!r} as {len(ids)} tokens; images need the family's image "
                     "tokens in its vocabulary (a SmolVLM / Idefics3 tokenizer)")
  return ids[0]


def encode_expansion(tokenizer: Tokenizer, rows: int, cols: int, image_seq_len: int) -> list[int]:
  """The token ids of one image's expansion, checked to hold one `<image>` token per feature row.

  Raises:
    ValueError: when the tokenizer does not encode the expansion's image tokens one each.
  """
  ids = tokenizer.encode(expansion(rows, cols, image_seq_len))
  tiles = rows * cols + 1 if rows or cols else 1
  found = ids.count(image_token_id(tokenizer))
  if found != tiles * image_seq_len:
    raise ValueError(f"an image of {tiles} tiles x {image_seq_len} tokens encodes to {found} {IMAGE} tokens; the "
                     "tokenizer must hold the family's image tokens as special tokens")
  return ids


def image_slots(tokens: np.ndarray, image_id: int) -> np.ndarray:
  """int32 slots of a token array: the k-th `<image>` token (0-based, along the last axis) holds k, others -1."""
  is_image = tokens == image_id
  return np.where(is_image, np.cumsum(is_image, axis=-1) - 1, -1).astype(np.int32)
