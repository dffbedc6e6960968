"""Image tiles equal transformers' Idefics3 PIL image processor's, and bad image data fails by name."""

import io

import numpy as np
import pytest
from PIL import Image
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

from ptx.data.images import ImageConfig, load, pad_tiles, tile

# Small tiles keep the parity cases fast; the sizes cover both aspect orientations, an image smaller than one tile,
# exactly one tile, odd edges and an extreme strip.
SMALL = ImageConfig(longest_edge=96, tile_size=32)
SIZES = [(20, 30), (30, 20), (32, 32), (37, 53), (70, 41), (5, 90), (200, 7)]
# Resized to at most one tile: the image is its own global tile, with no grid.
ONE_TILE = ImageConfig(longest_edge=24, tile_size=32)


def _reference(cfg: ImageConfig, resample=None) -> Idefics3ImageProcessorPil:
  kwargs = {} if resample is None else {"resample": resample}
  return Idefics3ImageProcessorPil(size={"longest_edge": cfg.longest_edge},
                                   max_image_size={"longest_edge": cfg.tile_size}, **kwargs)


def _random_image(rng, height, width, mode="RGB") -> Image.Image:
  channels = len(mode)
  return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8).squeeze(), mode)


@pytest.mark.parametrize("cfg, size", [(SMALL, s) for s in SIZES] + [(ONE_TILE, (37, 53)), (ONE_TILE, (53, 37))])
def test_tiles_equal_the_reference(cfg, size):
  image = _random_image(np.random.default_rng(sum(size)), *size)
  want = _reference(cfg)(images=[image], return_row_col_info=True)
  got = tile(load(_png(image)), cfg)
  assert (got.rows, got.cols) == (want["rows"][0][0], want["cols"][0][0])
  # The same PIL resizes at 8 bits, then the same float32 operations element by element: bit-identical.
  np.testing.assert_array_equal(got.pixel_values, np.asarray(want["pixel_values"][0]))


def test_the_default_config_is_the_processor_default():
  image = _random_image(np.random.default_rng(0), 300, 400)
  want = Idefics3ImageProcessorPil()(images=[image], return_row_col_info=True)
  got = tile(image, ImageConfig())
  assert (got.rows, got.cols) == (3, 4) == (want["rows"][0][0], want["cols"][0][0])
  assert got.pixel_values.shape == (13, 3, 364, 364)
  # Bit-identical, as above.
  np.testing.assert_array_equal(got.pixel_values, np.asarray(want["pixel_values"][0]))


def test_a_batch_pads_with_empty_tiles_as_the_reference():
  rng = np.random.default_rng(1)
  samples = [[_random_image(rng, 20, 30), _random_image(rng, 70, 41)], [_random_image(rng, 16, 16)]]
  want = _reference(SMALL)(images=samples)
  n = want["pixel_values"].shape[1]
  for s, images in enumerate(samples):
    pixel_values, mask = pad_tiles([tile(im, SMALL).pixel_values for im in images], n)
    np.testing.assert_array_equal(mask, want["pixel_attention_mask"][s])
    np.testing.assert_array_equal(pixel_values, want["pixel_values"][s])  # bit-identical, as above
  with pytest.raises(ValueError, match="2 images have 14 tiles, more than the 5 of a row"):
    pad_tiles([tile(im, SMALL).pixel_values for im in samples[0]], 5)


def test_another_filter_breaks_parity():
  # The parity tests can fail: the reference with bicubic instead of its Lanczos default is far off.
  image = _random_image(np.random.default_rng(2), 37, 53)
  want = np.asarray(_reference(SMALL, resample=Image.Resampling.BICUBIC)(images=[image])["pixel_values"][0])
  assert np.abs(tile(image, SMALL).pixel_values - want).max() > 0.01
  np.testing.assert_array_equal(
      tile(image, ImageConfig(longest_edge=96, tile_size=32, resample="bicubic")).pixel_values, want)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P"])
def test_other_modes_become_rgb_as_the_reference_converts_them(mode):
  rng = np.random.default_rng(3)
  image = _random_image(rng, 30, 20, "RGBA" if mode == "P" else mode)
  if mode == "P":
    image = image.convert("RGB").quantize(7)
    image.info["transparency"] = 2
  want = _reference(SMALL)(images=[image])["pixel_values"][0]
  data = _png(image)
  np.testing.assert_array_equal(tile(load(data), SMALL).pixel_values, np.asarray(want))  # bit-identical, as above


def test_bad_image_data_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError):
    load(tmp_path / "missing.png")
  good = _png(_random_image(np.random.default_rng(4), 9, 9))
  for data, message in [(b"", "not an image format"), (b"not an image", "not an image format"),
                        (good[:60], "truncated")]:
    with pytest.raises(ValueError, match=message):
      load(data)


@pytest.mark.parametrize("field, value", [("resample", "sharpest"), ("tile_size", 0), ("std", (1.0, 0.0, 1.0)),
                                          ("mean", (0.5, 0.5))])
def test_config_refuses_bad_fields_by_name(field, value):
  with pytest.raises(ValueError, match=f"ImageConfig.{field}"):
    ImageConfig(**{field: value})


def _png(image: Image.Image) -> bytes:
  out = io.BytesIO()
  image.save(out, "PNG")
  return out.getvalue()
