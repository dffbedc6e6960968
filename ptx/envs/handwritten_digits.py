"""Sums of real handwritten digits: scikit-learn's bundled 1,797 8x8 digits, composed side by side.

The digits are read from the installed scikit-learn wheel's `sklearn/datasets/data/digits.csv.gz` (never imported:
its package imports scipy and more), the data `sklearn.datasets.load_digits` returns: 64 pixels of 0..16 ink and the
label per row. scikit-learn is the `digits` extra (`pip install 'ptx[digits]'`); without it `DigitSums` is refused
by name.

The train / held-out split is of the images, by index in that file, fixed: image i is held out when
`ptx.data.splits.split_of("digit image i")` says so (about one in four), so a held-out problem shows only images no
training problem shows, whatever the seeds.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.util
import pathlib
from typing import ClassVar

import numpy as np
from PIL import Image

from ptx.data import splits
from ptx.envs.visual import Problem

INSTALL = "pip install 'ptx[digits]'"
IMAGES = 1797  # rows of digits.csv.gz
_INK_LEVELS = 16  # a pixel's ink runs 0..16


def data_file() -> pathlib.Path:
  """The installed scikit-learn's digits.csv.gz.

  Raises:
    ModuleNotFoundError: scikit-learn is not installed (naming the task and the extra).
  """
  spec = importlib.util.find_spec("sklearn")
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(f"the digit_sums task draws scikit-learn's bundled handwritten digits; install them "
                              f"with `{INSTALL}`")
  return pathlib.Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"


@functools.cache
def digits() -> tuple[np.ndarray, np.ndarray]:
  """(images uint8 [1797, 8, 8] of ink 0..16, labels int64 [1797]), in the file's order."""
  with gzip.open(data_file(), "rt") as f:
    table = np.loadtxt(f, delimiter=",")
  if table.shape != (IMAGES, 65):
    raise ValueError(f"{data_file()}: expected {IMAGES} rows of 64 pixels and a label, got shape {table.shape}")
  return table[:, :64].reshape(-1, 8, 8).astype(np.uint8), table[:, 64].astype(np.int64)


@functools.cache
def indices(split: str) -> np.ndarray:
  """The indices of the images of `split`, ascending."""
  splits.check("handwritten_digits.indices", split)
  return np.asarray([i for i in range(IMAGES) if splits.split_of(f"digit image {i}") == split])


@dataclasses.dataclass(frozen=True)
class DigitSums:
  """The sum of handwritten digits shown side by side."""

  family: ClassVar[str] = "digit_sums"
  # Digits shown (more: a longer sum).
  count: int = 2
  # Image pixels per digit pixel (an 8x8 digit becomes 8*scale square).
  scale: int = 8

  def __post_init__(self):
    if not 2 <= self.count <= 8:
      raise ValueError(f"DigitSums.count must be in [2, 8], got {self.count}")
    if not 1 <= self.scale <= 32:
      raise ValueError(f"DigitSums.scale must be in [1, 32], got {self.scale}")
    data_file()

  def draw(self, rng: np.random.Generator, split: str) -> Problem:
    """A sum of `count` distinct images of `split`."""
    images, labels = digits()
    chosen = [int(i) for i in rng.choice(indices(split), self.count, replace=False)]
    side, gap = 8 * self.scale, 2 * self.scale
    canvas = Image.new("RGB", (self.count * side + (self.count + 1) * gap, side + 2 * gap), "white")
    for k, i in enumerate(chosen):
      ink = (255 - images[i].astype(np.int32) * 255 // _INK_LEVELS).astype(np.uint8)  # dark ink on white
      digit = Image.fromarray(ink).resize((side, side), Image.Resampling.NEAREST).convert("RGB")
      canvas.paste(digit, (gap + k * (side + gap), gap))
    question = f"The image shows {self.count} handwritten digits. What is their sum?"
    return Problem(canvas, question, str(int(labels[chosen].sum())), "number",
                   f"digits {','.join(map(str, chosen))}")
