"""Image preprocessing of the Idefics3 / SmolVLM family: decoded images to normalised tiles.

What transformers 5.24's `Idefics3ImageProcessorPil` (and `SmolVLMImageProcessorPil`, the same code) does with its
default settings, in numpy and PIL:

  decode -> RGB (transparency composited onto white)
    -> resize so the longest edge is `longest_edge` (the other edge keeps the aspect ratio, rounded up to even)
    -> resize both edges up to multiples of `tile_size`
    -> if larger than one tile: the rows x cols tiles in row-major order, then the whole image resized to one tile
       (the global image); else the one tile, rows = cols = 0
    -> rescale by 1/255 (in float64, stored float32), normalise by `mean` and `std` (float32)

Every resize goes through PIL at 8 bits per channel with the configured filter, as the reference's does, so the
pixels match it to float32 rounding. Every tile is `tile_size` square; `pad_tiles` lays several images' tiles out
at a fixed tile count with the pixel attention mask (1 on pixels of a real tile, 0 on padding tiles), as the
reference pads a batch.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os

import numpy as np
from PIL import Image

from ptx.config import DataConfig
from ptx.model_config import VisionConfig

# The reference's cap on either edge after the first resize (transformers' MAX_IMAGE_SIZE).
_MAX_EDGE = 4096
_FILTERS = {f.name.lower(): f for f in Image.Resampling}


@dataclasses.dataclass(frozen=True)
class ImageConfig:
  """How an image becomes tiles and tokens (defaults: transformers' Idefics3 processor)."""

  # Longest edge of the image after the first resize (the processor's size["longest_edge"]; SmolVLM: 4 x 512).
  longest_edge: int = 4 * 364
  # Side of a square tile: the vision encoder's image size (max_image_size["longest_edge"]; SmolVLM: 512).
  tile_size: int = 364
  # <image> tokens per tile: (tile_size / patch_size)^2 / scale_factor^2 (Idefics3-8B: 169; SmolVLM-256M: 64).
  image_seq_len: int = 169
  # Per-channel mean subtracted after rescaling to [0, 1] (SigLIP's, the processor's IMAGENET_STANDARD_MEAN).
  mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
  # Per-channel standard deviation divided by after the mean (IMAGENET_STANDARD_STD).
  std: tuple[float, float, float] = (0.5, 0.5, 0.5)
  # PIL resampling filter of every resize, by name ("lanczos", "bicubic", "bilinear", ...).
  resample: str = "lanczos"

  def __post_init__(self):
    if self.resample not in _FILTERS:
      raise ValueError(f"ImageConfig.resample must be one of {sorted(_FILTERS)}, got {self.resample!r}")
    for name in ("longest_edge", "tile_size", "image_seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"ImageConfig.{name} must be >= 1, got {getattr(self, name)}")
    for name in ("mean", "std"):
      if len(getattr(self, name)) != 3:
        raise ValueError(f"ImageConfig.{name} needs one value per RGB channel, got {getattr(self, name)}")
    if min(self.std) <= 0:
      raise ValueError(f"ImageConfig.std must be positive, got {self.std}")


def image_config(vision: VisionConfig, data: DataConfig) -> ImageConfig | None:
  """How a job's images become tiles and tokens: tiles the tower's size, a tile's tokens its features.

  Args:
    vision: the model's vision tower (`model.vision`).
    data: the data config (`tiles_per_row`, `image_tiles_per_edge`).

  Returns:
    The image config, or None for text-only data (`data.tiles_per_row` 0).

  Raises:
    ValueError: for data with images and a model without a vision tower.
  """
  if not data.tiles_per_row:
    return None
  if not vision.enabled:
    raise ValueError(f"data.tiles_per_row={data.tiles_per_row} needs a model with a vision tower (model.vision.depth "
                     "is 0)")
  return ImageConfig(longest_edge=data.image_tiles_per_edge * vision.image_size, tile_size=vision.image_size,
                     image_seq_len=vision.tokens_per_image)


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One image as the vision encoder reads it."""

  # float32 [n, 3, tile_size, tile_size]: rows x cols tiles then the global image (n = rows cols + 1), or one tile.
  pixel_values: np.ndarray
  # Tile rows and columns (both 0 for an image that fits one tile).
  rows: int
  cols: int


def load(source: str | os.PathLike | bytes) -> Image.Image:
  """Decodes an image file or its bytes into RGB, as the reference converts it.

  Args:
    source: a path, or the encoded bytes (PNG, JPEG, ... whatever PIL reads).

  Returns:
    The decoded RGB image; transparency is composited onto white.

  Raises:
    FileNotFoundError: a path that does not exist.
    ValueError: data PIL cannot decode: not an image, truncated, or of
      zero width or height (which PIL refuses to open).
  """
  try:
    image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    image.load()
  except FileNotFoundError:
    raise
  except Image.UnidentifiedImageError:
    raise ValueError("cannot decode image: not an image format PIL reads, or one of zero size") from None
  except (OSError, SyntaxError) as e:
    raise ValueError(f"cannot decode image: {e}") from None
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
  return image.convert("RGB")


def tile(image: Image.Image, cfg: ImageConfig) -> Tiles:
  """Resizes, splits, rescales and normalises one RGB image.

  Args:
    image: an RGB image (`load`).
    cfg: the processing parameters.

  Returns:
    Its tiles and their grid.
  """
  resample = _FILTERS[cfg.resample]
  s = cfg.tile_size
  image = image.resize(_longest_edge_size(image.width, image.height, cfg.longest_edge), resample)
  image = image.resize(_tile_multiple_size(image.width, image.height, s), resample)
  if image.width > s or image.height > s:
    rows, cols = image.height // s, image.width // s
    crops = [image.crop((c * s, r * s, (c + 1) * s, (r + 1) * s)) for r in range(rows) for c in range(cols)]
    frames = crops + [image.resize((s, s), resample)]
  else:
    rows = cols = 0
    frames = [image]
  pixels = np.stack([np.asarray(f) for f in frames]).transpose(0, 3, 1, 2)  # [n, 3, s, s] uint8
  # As the reference: rescale in float64, store float32, then normalise in float32.
  x = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
  mean = np.asarray(cfg.mean, np.float32)[:, None, None]
  std = np.asarray(cfg.std, np.float32)[:, None, None]
  return Tiles((x - mean) / std, rows, cols)


def pad_tiles(images: list[np.ndarray], num_tiles: int) -> tuple[np.ndarray, np.ndarray]:
  """Lays the tiles of several images out one after another and pads with empty tiles.

  Args:
    images: each image's `Tiles.pixel_values`, all of one tile size.
    num_tiles: N, the tiles of the result (a static shape for the model).

  Returns:
    (pixel_values float32 [N, 3, S, S], zero on padding tiles;
     pixel_attention_mask int32 [N, S, S], 1 on real tiles' pixels, 0 on padding tiles).

  Raises:
    ValueError: when the images have more than `num_tiles` tiles together.
  """
  n = sum(len(x) for x in images)
  if n > num_tiles:
    raise ValueError(f"{len(images)} images have {n} tiles, more than the {num_tiles} of a row")
  if not images:
    raise ValueError("pad_tiles needs at least one image to know the tile size")
  size = images[0].shape[-1]
  pixel_values = np.zeros((num_tiles, 3, size, size), np.float32)
  mask = np.zeros((num_tiles, size, size), np.int32)
  if n:
    pixel_values[:n] = np.concatenate(images)
    mask[:n] = 1
  return pixel_values, mask


def _longest_edge_size(width: int, height: int, longest_edge: int) -> tuple[int, int]:
  """(width, height) with the longest edge at `longest_edge`, the other even, then capped at 4096."""
  aspect = width / height
  if width >= height:
    width = longest_edge
    height = int(width / aspect)
    height += height % 2
  else:
    height = longest_edge
    width = int(height * aspect)
    width += width % 2
  width, height = max(width, 1), max(height, 1)
  aspect = width / height
  if width >= height and width > _MAX_EDGE:
    width, height = _MAX_EDGE, int(_MAX_EDGE / aspect)
  elif height > width and height > _MAX_EDGE:
    width, height = int(_MAX_EDGE * aspect), _MAX_EDGE
  return max(width, 1), max(height, 1)


def _tile_multiple_size(width: int, height: int, tile_size: int) -> tuple[int, int]:
  """(width, height) rounded up to multiples of `tile_size`, the shorter edge from the aspect ratio."""
  aspect = width / height
  if width >= height:
    width = math.ceil(width / tile_size) * tile_size
    height = math.ceil(int(width / aspect) / tile_size) * tile_size
  else:
    height = math.ceil(height / tile_size) * tile_size
    width = math.ceil(int(height * aspect) / tile_size) * tile_size
  return width, height
