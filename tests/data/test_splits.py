"""ptx.data.splits: every built-in task generator's train and held-out streams share no problem."""

import re

import pytest
from problems import arithmetic as arithmetic_identity

from ptx.data import splits
from ptx.data.arithmetic import ArithmeticTask, identity
from ptx.envs import suites
from ptx.envs.countdown import CountdownTask
from ptx.envs.needle import NeedleTask


def test_the_split_is_a_fixed_function_of_the_identity():
  # Golden values: a split that moved with the process (Python's salted hash), the seed or the index would change them.
  assert [splits.split_of(f"{a}+{b}") for a in range(4) for b in range(a, 4)] == [
      "train", "train", "train", "held_out", "train", "train", "train", "train", "train", "held_out"]
  assert [splits.split_of(i) for i in ("12+34", "amber-123")] == ["train", "held_out"]


def test_one_digit_addition_has_both_sides_and_says_how_many():
  sizes = ArithmeticTask(max_digits=1).split_sizes()
  assert sizes == {"train": 74, "held_out": 26} and sum(sizes.values()) == 100
  held_out = {ArithmeticTask(seed, 1, split="held_out")[i]["prompt"] for seed in range(3) for i in range(300)}
  train = {ArithmeticTask(seed, 1)[i]["prompt"] for seed in range(3) for i in range(300)}
  assert len(held_out) == 26 and len(train) == 74 and not held_out & train  # 900 draws a side reach every problem


def test_commuted_problems_fall_on_one_side():
  assert {splits.split_of(identity(3, "+", 5)), splits.split_of(identity(5, "+", 3))} == {splits.split_of("3+5")}
  assert identity(5, "-", 3) != identity(3, "-", 5)


@pytest.mark.parametrize("task", [ArithmeticTask(0, 2), ArithmeticTask(0, 3, "+-*"), ArithmeticTask(0, 1)])
def test_arithmetic_streams_of_one_seed_are_disjoint(task):
  train = {arithmetic_identity(task[i]["prompt"]) for i in range(5000)}
  held_out_task = ArithmeticTask(task.seed, task.max_digits, task.ops, split="held_out")
  held_out = {arithmetic_identity(held_out_task[i]["prompt"]) for i in range(1000)}
  assert train & held_out == set()
  assert all(splits.split_of(i) == "held_out" for i in held_out) and len(held_out) >= 14


def test_countdown_streams_of_one_seed_are_disjoint():
  def problems(split, n):
    tasks = CountdownTask(seed=0, split=split)
    return {f"{sorted(t['numbers'])}->{t['target']}" for t in (tasks[i] for i in range(n))}

  train, held_out = problems("train", 2000), problems("held_out", 300)
  assert len(held_out) >= 290 and train & held_out == set()


def test_needle_streams_of_one_seed_never_share_a_key():
  def keys(split, n):
    tasks = NeedleTask(seed=0, lengths=(30, 50, 70), depths=(0.0, 0.5, 1.0), split=split)
    return {re.search(r"magic number for (\S+) is", tasks[i]["prompt"]).group(1) for i in range(n)}

  train, held_out = keys("train", 2000), keys("held_out", 300)
  assert len(held_out) >= 250 and train & held_out == set()


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "needle"])
def test_generated_evaluation_suites_are_held_out(name):
  _, records = suites.load(name, n=30, seed=0)
  trained = {"arithmetic": ArithmeticTask(0, 3, "+-*"), "countdown": CountdownTask(0), "needle": NeedleTask(0)}[name]
  assert not {r["prompt"] for r in records} & {trained[i]["prompt"] for i in range(300)}


@pytest.mark.parametrize("make", [ArithmeticTask, CountdownTask, NeedleTask])
def test_an_unknown_split_is_refused_naming_the_field(make):
  with pytest.raises(ValueError, match=rf"{make.__name__}\.split must be one of"):
    make(split="test")


def test_a_space_without_a_held_out_side_is_an_error_naming_its_owner():
  with pytest.raises(ValueError, match="toy: no problem of split 'held_out'"):
    splits.draw("toy", "held_out", lambda: ("0+0", None))  # "0+0" is on the train side
