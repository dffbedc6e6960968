"""ptx.envs.visual_tasks, ptx.envs.handwritten_digits: seeded image questions whose pictures show their answers,
split into train and held-out by construction."""

import base64
import importlib.util
import io
import json
import math
import re

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage

from ptx.data import image_chat, images, splits
from ptx.envs import handwritten_digits, suites
from ptx.envs.handwritten_digits import DigitSums
from ptx.envs.visual import VisualEnv, VisualTasks
from ptx.envs.visual_tasks import COLOURS, GENERATORS, BarChart, Clock, Counting, Grid, Table

ALL = {**{family: make() for family, make in GENERATORS.items()}, "digit_sums": DigitSums()}


def _image(record) -> np.ndarray:
  """The record's picture as uint8 [H, W, 3], decoded by the data layer that tiles it for the model."""
  return np.asarray(images.load(base64.b64decode(record["prompt"][0]["content"][0]["bytes"])))


def _question(record) -> str:
  return record["prompt"][0]["content"][1]["text"]


@pytest.mark.parametrize("family", sorted(ALL))
def test_records_are_seeded_image_chats_the_data_layer_and_the_environment_read(family):
  tasks = VisualTasks(ALL[family], seed=3)
  record = tasks[5]
  assert record == tasks[5] and record != VisualTasks(ALL[family], seed=4)[5]
  image_chat.validate(record["prompt"])
  VisualEnv().validate(record)
  assert _image(record).ndim == 3 and record["family"] == family and json.loads(json.dumps(record)) == record
  assert _question(record).endswith("Put the final answer in \\boxed{}.")


def test_counting_pictures_show_as_many_shapes_as_the_answer():
  # Counted from the pixels: components of the asked colour (shapes never touch), each named by how much of its
  # bounding box it fills (a square all, a circle pi/4, a triangle half).
  fills = {"square": 1.0, "circle": math.pi / 4, "triangle": 0.5}
  for i in range(12):
    record = VisualTasks(Counting(), seed=0)[i]
    colour, shape = re.match(r"How many (\w+) (\w+)s", _question(record)).groups()
    labels, n = ndimage.label((_image(record) == COLOURS[colour]).all(-1))
    kinds = []
    for box in ndimage.find_objects(labels):
      fill = (labels[box] > 0).mean()
      kinds.append(min(fills, key=lambda k: abs(fills[k] - fill)))
    assert str(kinds.count(shape)) == record["answer"], (i, kinds)


def test_clock_hands_point_at_the_time():
  # At 0.6 of the radius only the minute hand shows (the hour hand ends at 0.5, the numerals start further out); at
  # 0.4 the hour hand does too, at its angle: 30 degrees per hour and its share of the next.
  clock = Clock()
  for i in range(10):
    record = VisualTasks(clock, seed=1)[i]
    hour, minute = map(int, record["answer"].split(":"))
    pixels, c, r = _image(record).min(-1), clock.size / 2, clock.size / 2 - 4

    def dark(turns, length):  # within a pixel of the point: a 2-pixel line drawn at an angle
      angle = 2 * math.pi * turns
      y, x = round(c - length * r * math.cos(angle)), round(c + length * r * math.sin(angle))
      return pixels[y - 1:y + 2, x - 1:x + 2].min() < 128

    assert [m for m in range(0, 60, 5) if dark(m / 60, 0.6)] == [minute], i
    hours = [h for h in range(1, 13) if dark((h % 12 + minute / 60) / 12, 0.4) and abs(h * 5 % 60 - minute) > 5]
    assert hours == ([hour] if abs(hour * 5 % 60 - minute) > 5 else []), i


def test_bar_chart_bars_are_as_tall_as_their_values():
  # Bar heights in pixels against the gridlines' spacing (grey rows right of the last bar).
  chart = BarChart()
  for i in range(10):
    record = VisualTasks(chart, seed=2)[i]
    pixels = _image(record)
    blue = (pixels == COLOURS["blue"]).all(-1)
    columns = [c for c in ndimage.find_objects(ndimage.label(blue)[0])]
    heights = [box[0].stop - box[0].start for box in sorted(columns, key=lambda b: b[1].start)]
    grid_rows = np.flatnonzero((pixels[:, -8] == (205, 205, 205)).all(-1))
    step = np.diff(grid_rows).mean()
    values = [round(h / step) for h in heights]
    if record["answer_kind"] == "label":
      assert "ABCDEFGH"[values.index(max(values))] == record["answer"] and values.count(max(values)) == 1, i
    else:
      letter = re.search(r"bar (\w)\?", _question(record))[1]
      assert str(values["ABCDEFGH".index(letter)]) == record["answer"], (i, values)


def test_grid_cells_are_filled_as_the_answer_counts():
  grid = Grid()
  for i in range(10):
    record = VisualTasks(grid, seed=3)[i]
    pixels, side = _image(record).min(-1), (grid.size - 1) / grid.cells
    filled = np.array([[pixels[int((r + 0.5) * side), int((c + 0.5) * side)] < 128 for c in range(grid.cells)]
                       for r in range(grid.cells)])
    line, index = re.search(r"in (row|column) (\d)", _question(record)).groups()
    counted = filled[int(index) - 1] if line == "row" else filled[:, int(index) - 1]
    assert str(counted.sum()) == record["answer"], i


def test_table_is_ruled_by_its_rows_and_columns():
  pixels = _image(VisualTasks(Table(rows=5, columns=2), seed=0)[0]).min(-1)
  # Ruled lines: a dark row of pixels above, between and below the header and 5 rows, columns likewise.
  assert len(np.flatnonzero((pixels < 128).mean(1) > 0.9)) == 7
  assert len(np.flatnonzero((pixels < 128).mean(0) > 0.9)) == 4


def test_the_digits_are_scikit_learns_and_the_picture_shows_them():
  from sklearn.datasets import load_digits  # the reference loader of the file read here

  reference = load_digits()
  ours, labels = handwritten_digits.digits()
  np.testing.assert_array_equal(ours, reference.images)  # exact: integers 0..16 either way
  np.testing.assert_array_equal(labels, reference.target)
  # The composed picture's digits, read back (ink of each 8x8 cell), are the images its identity names.
  sums = DigitSums(count=3, scale=4)
  levels = 255 - np.arange(17) * 255 // 16
  for i in range(5):
    record = VisualTasks(sums, seed=0)[i]
    chosen = [int(k) for k in record["identity"].split()[1].split(",")]
    pixels, side, gap = _image(record)[..., 0], 8 * sums.scale, 2 * sums.scale
    for k, index in enumerate(chosen):
      block = pixels[gap:gap + side:sums.scale, gap + k * (side + gap):gap + k * (side + gap) + side:sums.scale]
      np.testing.assert_array_equal(np.abs(block[..., None].astype(int) - levels).argmin(-1), reference.images[index])
    assert record["answer"] == str(reference.target[chosen].sum())


def test_the_digits_task_is_refused_by_name_without_scikit_learn(monkeypatch):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else find_spec(name, *a))
  with pytest.raises(ModuleNotFoundError, match=r"digit_sums task .*pip install 'ptx\[digits\]'"):
    DigitSums()
  with pytest.raises(ModuleNotFoundError, match="digit_sums"):
    suites.load("visual_digit_sums", n=1)


# Knobs small enough that a train stream repeats its problems: disjointness below is not the luck of a large space.
SMALL = {"counting": Counting(min_shapes=2, max_shapes=3, colours=2), "clock": Clock(minute_step=15),
         "bar_chart": BarChart(bars=2, max_value=3), "table": Table(rows=2, columns=1, max_value=1),
         "grid": Grid(cells=2)}


@pytest.mark.parametrize("family", sorted(SMALL))
def test_no_held_out_problem_is_a_training_problem(family):
  def records(split):
    return [VisualTasks(SMALL[family], seed, split)[i] for seed in (0, 1) for i in range(60)]

  train, held_out = records("train"), records("held_out")
  train_ids = {r["identity"] for r in train}
  assert {r["identity"] for r in held_out}.isdisjoint(train_ids)
  assert {json.dumps(r["prompt"]) for r in held_out}.isdisjoint(json.dumps(r["prompt"]) for r in train)
  assert all(splits.split_of(r["identity"]) == "held_out" for r in held_out)
  # The two training seeds pose some of the same problems: the space is small enough for a leak to show.
  assert len(train_ids) < len(train)


def test_held_out_digit_sums_show_only_held_out_images():
  images_, _ = handwritten_digits.digits()
  train, held_out = handwritten_digits.indices("train"), handwritten_digits.indices("held_out")
  assert len(train) + len(held_out) == 1797 and set(train).isdisjoint(held_out) and 400 < len(held_out) < 500

  def shown(split):
    return {int(k) for seed in (0, 1) for i in range(100)
            for k in VisualTasks(DigitSums(), seed, split)[i]["identity"].split()[1].split(",")}

  shown_train, shown_held_out = shown("train"), shown("held_out")
  assert shown_held_out <= set(held_out) and shown_train <= set(train)
  # No held-out picture is a training one, pixel for pixel (the 1,797 images are distinct).
  train_pixels = {images_[k].tobytes() for k in train}
  assert not any(images_[k].tobytes() in train_pixels for k in held_out)
  assert len(shown_held_out) > 150  # 400 draws from ~450 images: the side is sampled broadly, not one corner


def test_knobs_out_of_range_are_refused_by_name():
  for make, field in ((lambda: Clock(minute_step=7), "Clock.minute_step"),
                      (lambda: Counting(colours=9), "Counting.colours"),
                      (lambda: BarChart(bars=9), "BarChart.bars"), (lambda: Table(rows=1), "Table.rows"),
                      (lambda: Grid(fill=1.5), "Grid.fill"), (lambda: DigitSums(count=1), "DigitSums.count")):
    with pytest.raises(ValueError, match=re.escape(field)):
      make()
  with pytest.raises(ValueError, match="VisualTasks.split"):
    VisualTasks(Grid(), split="test")


def test_harder_knobs_draw_harder_problems():
  assert {VisualTasks(Clock(minute_step=1), 0)[i]["answer"][-1] for i in range(40)} - {"0", "5"}
  assert max(int(VisualTasks(Counting(min_shapes=20, max_shapes=20, colours=1), 0)[i]["answer"])
             for i in range(10)) > 6
  assert Image.open(io.BytesIO(base64.b64decode(
      VisualTasks(Grid(cells=9, size=200), 0)[0]["prompt"][0]["content"][0]["bytes"]))).size == (200, 200)
