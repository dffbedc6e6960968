"""Procedural visual questions drawn with PIL: counting shapes, a clock, a bar chart, a table, a grid.

Each generator is a frozen dataclass whose fields are its difficulty knobs, and a `ptx.envs.visual.Generator`:
`draw(rng, split)` draws a scene (plain data) from `rng`, redrawing until the scene's identity is in `split`
(`ptx.data.splits`, the split every built-in task uses), then renders it. The identity is what a question is
about, so a held-out problem is one no training stream poses, whatever the seeds:

  counting   the scene's shapes as a multiset of (colour, shape) and the pair asked about (not where they lie)
  clock      the time shown
  bar_chart  the values and the question
  table      the table's names and cells and the question
  grid       the filled cells and the line asked about

Rendering is deterministic given the scene (PIL's bundled font, no antialiasing randomness).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ptx.data import splits
from ptx.envs.visual import Problem

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (214, 39, 40), "green": (44, 160, 44), "blue": (31, 119, 180), "orange": (255, 127, 14),
           "purple": (148, 103, 189), "brown": (140, 86, 75)}
_LETTERS = "ABCDEFGH"
NAMES = ("Ana", "Ben", "Cai", "Dora", "Eli", "Fay")
ITEMS = ("apples", "pears", "plums", "figs")
_INK = (0, 0, 0)
_FILLED = (60, 60, 60)


@functools.cache
def _font(size: int) -> ImageFont.FreeTypeFont:
  """PIL's bundled font at `size` pixels."""
  return ImageFont.load_default(size=size)


def _drawn(generator: Any, rng: np.random.Generator, split: str) -> Problem:
  """`generator`'s first scene whose identity is in `split`, rendered (a rejected scene is never drawn)."""

  def candidate() -> tuple[str, tuple[str, Any]]:
    identity, scene = generator.scene(rng)
    return identity, (identity, scene)

  return generator.render(*splits.draw(type(generator).__name__, split, candidate))


def _check(owner: str, **bounds: tuple[float, float, float]) -> None:
  """Raises a ValueError naming owner.field for each field value outside its [low, high]."""
  for name, (value, low, high) in bounds.items():
    if not low <= value <= high:
      raise ValueError(f"{owner}.{name} must be in [{low}, {high}], got {value}")


@dataclasses.dataclass(frozen=True)
class Counting:
  """How many shapes of one colour and kind, among non-overlapping shapes of several."""

  family: ClassVar[str] = "counting"
  # Shapes in a scene, at least.
  min_shapes: int = 3
  # Shapes in a scene, at most (more: harder counts).
  max_shapes: int = 12
  # Colours drawn from (the first of COLOURS): more colours, more distractors.
  colours: int = 4
  # Half the width of a shape in pixels (smaller: harder to see).
  radius: int = 12
  # Side of the square image in pixels.
  size: int = 192

  def __post_init__(self):
    _check("Counting", min_shapes=(self.min_shapes, 1, self.max_shapes), max_shapes=(self.max_shapes, 1, 30),
           colours=(self.colours, 1, len(COLOURS)), radius=(self.radius, 3, self.size // 8))

  def draw(self, rng: np.random.Generator, split: str) -> Problem:
    """A counting problem of `split`."""
    return _drawn(self, rng, split)

  def scene(self, rng: np.random.Generator) -> tuple[str, tuple[list[tuple[str, str]], tuple[str, str], list]]:
    """(identity, (the shapes' (colour, shape), the pair asked about, their centres))."""
    n = int(rng.integers(self.min_shapes, self.max_shapes + 1))
    kinds = [(list(COLOURS)[int(rng.integers(self.colours))], SHAPES[int(rng.integers(len(SHAPES)))])
             for _ in range(n)]
    asked = kinds[int(rng.integers(n))]
    return f"counting {sorted(kinds)} ask {asked}", (kinds, asked, self._centres(rng, n))

  def _centres(self, rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    """n centres at least 2.5 radii apart, inside the image: each drawn until it clears the ones placed."""
    low, high, gap = self.radius + 2, self.size - self.radius - 2, 2.5 * self.radius
    centres: list[tuple[int, int]] = []
    for _ in range(100 * n):
      centre = (int(rng.integers(low, high)), int(rng.integers(low, high)))
      if all(math.dist(centre, c) >= gap for c in centres):
        centres.append(centre)
        if len(centres) == n:
          return centres
    raise ValueError(f"Counting: {n} shapes of radius {self.radius} do not fit a {self.size}-pixel image")

  def render(self, identity: str, scene: tuple) -> Problem:
    """Draws the shapes on white."""
    kinds, asked, centres = scene
    image = Image.new("RGB", (self.size, self.size), "white")
    draw = ImageDraw.Draw(image)
    r = self.radius
    for (colour, shape), (x, y) in zip(kinds, centres):
      box = (x - r, y - r, x + r, y + r)
      if shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
      elif shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
      else:
        draw.polygon([(x, y - r), (x + r, y + r), (x - r, y + r)], fill=COLOURS[colour])
    question = f"How many {asked[0]} {asked[1]}s are in the image?"
    return Problem(image, question, str(kinds.count(asked)), "number", identity)


@dataclasses.dataclass(frozen=True)
class Clock:
  """The time an analogue clock shows, as H:MM."""

  family: ClassVar[str] = "clock"
  # Minutes between the times shown: 5 puts the minute hand on a mark, 1 anywhere (harder); divides 60.
  minute_step: int = 5
  # Write the hours 1 to 12 around the dial.
  numerals: bool = True
  # Side of the square image in pixels.
  size: int = 160

  def __post_init__(self):
    _check("Clock", size=(self.size, 48, 1024))
    if 60 % self.minute_step:
      raise ValueError(f"Clock.minute_step must divide 60, got {self.minute_step}")

  def draw(self, rng: np.random.Generator, split: str) -> Problem:
    """A clock problem of `split`."""
    return _drawn(self, rng, split)

  def scene(self, rng: np.random.Generator) -> tuple[str, tuple[int, int]]:
    """(identity, (hour 1..12, minute))."""
    hour, minute = int(rng.integers(1, 13)), self.minute_step * int(rng.integers(60 // self.minute_step))
    return f"clock {hour}:{minute:02d}", (hour, minute)

  def render(self, identity: str, scene: tuple[int, int]) -> Problem:
    """Draws the dial, its minute marks, the numerals and the two hands."""
    hour, minute = scene
    image = Image.new("RGB", (self.size, self.size), "white")
    draw = ImageDraw.Draw(image)
    c, r = self.size / 2, self.size / 2 - 4

    def point(turns: float, length: float) -> tuple[float, float]:  # turns clockwise from 12
      return c + length * r * math.sin(2 * math.pi * turns), c - length * r * math.cos(2 * math.pi * turns)

    draw.ellipse((c - r, c - r, c + r, c + r), outline=_INK, width=3)
    for mark in range(60):
      draw.line([point(mark / 60, 0.85 if mark % 5 == 0 else 0.92), point(mark / 60, 0.98)], fill=_INK,
                width=3 if mark % 5 == 0 else 1)
    if self.numerals:
      for h in range(1, 13):
        draw.text(point(h / 12, 0.72), str(h), fill=_INK, font=_font(max(8, self.size // 12)), anchor="mm")
    draw.line([(c, c), point((hour % 12 + minute / 60) / 12, 0.5)], fill=_INK, width=max(3, self.size // 30))
    draw.line([(c, c), point(minute / 60, 0.8)], fill=_INK, width=max(2, self.size // 60))
    question = "What time does the clock show? Answer as H:MM."
    return Problem(image, question, f"{hour}:{minute:02d}", "time", identity)


@dataclasses.dataclass(frozen=True)
class BarChart:
  """A bar chart: which bar is tallest (a letter), or one bar's value."""

  family: ClassVar[str] = "bar_chart"
  # Bars, labelled A, B, ... (at most 8).
  bars: int = 5
  # Values are integers 1..max_value, the axis labelled at each (a larger range is harder to read).
  max_value: int = 10
  # Draw a gridline at each value (without: read against the axis alone).
  gridlines: bool = True
  # Side of the square image in pixels.
  size: int = 192

  def __post_init__(self):
    _check("BarChart", bars=(self.bars, 2, len(_LETTERS)), max_value=(self.max_value, 2, 20),
           size=(self.size, 96, 1024))

  def draw(self, rng: np.random.Generator, split: str) -> Problem:
    """A bar chart problem of `split`."""
    return _drawn(self, rng, split)

  def scene(self, rng: np.random.Generator) -> tuple[str, tuple[list[int], int | None]]:
    """(identity, (the values, the bar asked about: None asks for the tallest, which is then unique))."""
    values = [int(v) for v in rng.integers(1, self.max_value + 1, self.bars)]
    asked = int(rng.integers(self.bars)) if rng.random() < 0.5 or values.count(max(values)) > 1 else None
    return f"bars {values} ask {'tallest' if asked is None else _LETTERS[asked]}", (values, asked)

  def render(self, identity: str, scene: tuple[list[int], int | None]) -> Problem:
    """Draws the axes, the value labels, the gridlines and the bars."""
    values, asked = scene
    image = Image.new("RGB", (self.size, self.size), "white")
    draw = ImageDraw.Draw(image)
    font = _font(max(8, self.size // 18))
    left, right, top, bottom = self.size * 0.15, self.size - 6, 8, self.size * 0.88
    step = (bottom - top) / self.max_value
    for v in range(self.max_value + 1):
      y = bottom - v * step
      if self.gridlines and v:
        draw.line([(left, y), (right, y)], fill=(205, 205, 205))
      draw.text((left - 4, y), str(v), fill=_INK, font=font, anchor="rm")
    width = (right - left) / self.bars
    for i, v in enumerate(values):
      x0 = left + i * width + width * 0.2
      draw.rectangle((x0, bottom - v * step, x0 + width * 0.6, bottom), fill=COLOURS["blue"])
      draw.text((x0 + width * 0.3, bottom + 3), _LETTERS[i], fill=_INK, font=font, anchor="mt")
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=_INK, width=2)
    if asked is None:
      tallest = _LETTERS[values.index(max(values))]
      return Problem(image, "Which bar is the tallest? Answer with its letter.", tallest, "label", identity)
    return Problem(image, f"What is the value of bar {_LETTERS[asked]}?", str(values[asked]), "number", identity)


@dataclasses.dataclass(frozen=True)
class Table:
  """A rendered table of fruit per person: one cell, or a column's total."""

  family: ClassVar[str] = "table"
  # People (rows), at most len(NAMES).
  rows: int = 4
  # Fruits (columns), at most len(ITEMS).
  columns: int = 3
  # Cells are integers 0..max_value (larger: harder totals).
  max_value: int = 30
  # Chance a question asks for a column's total rather than one cell.
  totals: float = 0.5

  def __post_init__(self):
    _check("Table", rows=(self.rows, 2, len(NAMES)), columns=(self.columns, 1, len(ITEMS)),
           max_value=(self.max_value, 1, 999), totals=(self.totals, 0.0, 1.0))

  def draw(self, rng: np.random.Generator, split: str) -> Problem:
    """A table problem of `split`."""
    return _drawn(self, rng, split)

  def scene(self, rng: np.random.Generator) -> tuple[str, tuple[list[str], list[list[int]], int, int | None]]:
    """(identity, (the row names, the cells, the column asked about, its row or None for the column's total))."""
    names = [NAMES[int(i)] for i in rng.permutation(len(NAMES))[:self.rows]]
    cells = [[int(v) for v in rng.integers(0, self.max_value + 1, self.columns)] for _ in names]
    column = int(rng.integers(self.columns))
    row = None if rng.random() < self.totals else int(rng.integers(self.rows))
    return f"table {names} {cells} ask {column} {row}", (names, cells, column, row)

  def render(self, identity: str, scene: tuple) -> Problem:
    """Draws the table: a header row of fruits, then one row per person, ruled."""
    names, cells, column, row = scene
    font, cell_w, cell_h = _font(14), 64, 24
    image = Image.new("RGB", (cell_w * (self.columns + 1) + 1, cell_h * (self.rows + 1) + 1), "white")
    draw = ImageDraw.Draw(image)
    lines = [["Name", *ITEMS[:self.columns]]] + [[name, *map(str, values)] for name, values in zip(names, cells)]
    for i, line in enumerate(lines):
      for j, text in enumerate(line):
        draw.rectangle((j * cell_w, i * cell_h, (j + 1) * cell_w, (i + 1) * cell_h), outline=_INK)
        draw.text((j * cell_w + cell_w / 2, i * cell_h + cell_h / 2), text, fill=_INK, font=font, anchor="mm")
    item = ITEMS[column]
    if row is None:
      return Problem(image, f"How many {item} are there in total?", str(sum(r[column] for r in cells)), "number",
                     identity)
    return Problem(image, f"How many {item} does {names[row]} have?", str(cells[row][column]), "number", identity)


@dataclasses.dataclass(frozen=True)
class Grid:
  """How many cells of a row or column of a grid are filled."""

  family: ClassVar[str] = "grid"
  # The grid is cells x cells.
  cells: int = 5
  # Chance each cell is filled.
  fill: float = 0.4
  # Side of the square image in pixels.
  size: int = 160

  def __post_init__(self):
    _check("Grid", cells=(self.cells, 2, 16), fill=(self.fill, 0.0, 1.0), size=(self.size, 4 * self.cells, 1024))

  def draw(self, rng: np.random.Generator, split: str) -> Problem:
    """A grid problem of `split`."""
    return _drawn(self, rng, split)

  def scene(self, rng: np.random.Generator) -> tuple[str, tuple[np.ndarray, str, int]]:
    """(identity, (the filled cells [row, column], "row" or "column", its index from 0))."""
    filled = rng.random((self.cells, self.cells)) < self.fill
    line, index = ("row", "column")[int(rng.integers(2))], int(rng.integers(self.cells))
    bits = "".join("1" if f else "0" for f in filled.ravel())
    return f"grid {self.cells} {bits} ask {line} {index}", (filled, line, index)

  def render(self, identity: str, scene: tuple[np.ndarray, str, int]) -> Problem:
    """Draws the ruled grid with its filled cells dark."""
    filled, line, index = scene
    image = Image.new("RGB", (self.size, self.size), "white")
    draw = ImageDraw.Draw(image)
    side = (self.size - 1) / self.cells
    for i in range(self.cells):
      for j in range(self.cells):
        draw.rectangle((j * side, i * side, (j + 1) * side, (i + 1) * side), outline=_INK,
                       fill=_FILLED if filled[i, j] else None)
    counted = filled[index] if line == "row" else filled[:, index]
    where = "from the top" if line == "row" else "from the left"
    question = f"How many cells are filled in {line} {index + 1} (counting {where})?"
    return Problem(image, question, str(int(counted.sum())), "number", identity)


# Family name: the generator with its default knobs.
GENERATORS: dict[str, Callable[[], Any]] = {g.family: g for g in (Counting, Clock, BarChart, Table, Grid)}
