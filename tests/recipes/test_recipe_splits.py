"""Each recipe's training records and held-out records share no problem, at the sizes the recipe draws."""

import importlib
import pathlib
import re

import problems
import pytest

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(autouse=True)
def recipes_importable(monkeypatch):
  monkeypatch.syspath_prepend(str(RECIPES))


def arithmetic_chat(record: dict) -> str:
  return problems.arithmetic(re.fullmatch(r"What is (.+)\?", record["messages"][0]["content"]).group(1) + "=")


def apples(record: dict) -> str:
  name, a, b = re.match(r"(\w+) has (\d+) apples and buys (\d+) more", record["question"]).groups()
  return f"{name}:{sorted((int(a), int(b)))}"


def needle_key(record: dict) -> str:
  return re.search(r"magic number for (\S+) is", record["messages"][0]["content"]).group(1)


# recipe: (its synthetic records, how many its main() trains on, the problem a record poses); 64 are held out
# (recipes/launch.py).
CASES = {
    "dpo": ("synthetic_pairs", 2000, lambda r: problems.arithmetic(r["prompt"])),
    "sft_chat": ("synthetic_chats", 4000, arithmetic_chat),
    "grpo_math": ("synthetic_problems", 512, apples),
    "long_context_sft": ("synthetic_needles", 512, needle_key),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiny_preset_trains_on_no_held_out_problem(name):
  function, n, problem = CASES[name]
  synthetic = getattr(importlib.import_module(name), function)
  train, held_out = {problem(r) for r in synthetic("train", n)}, {problem(r) for r in synthetic("held_out", 64)}
  assert len(held_out) >= 40 and train & held_out == set()


class ChatTemplate:
  """A stand-in for the tokenizer's chat template: the user turn's text."""

  def render(self, messages, add_generation_prompt):
    return messages[-1]["content"]


def test_grpo_smollm2_scores_no_training_prompt():
  import grpo_smollm2

  preset = grpo_smollm2.PRESETS["full"]()
  seen = preset.train.steps * preset.data.batch_size  # the prompts its steps read

  def problem(record):
    return problems.arithmetic(re.search(r"What is (\d+) \+ (\d+)\?", record["prompt"]).expand(r"\1+\2="))

  train = grpo_smollm2.ChatAddition(ChatTemplate(), grpo_smollm2.TRAIN_SEED, "train")
  held_out = grpo_smollm2.ChatAddition(ChatTemplate(), grpo_smollm2.EVAL_SEED, "held_out")
  scored = {problem(held_out[i]) for i in range(grpo_smollm2.EVAL_SIZE["full"])}
  assert len(scored) >= 10 and {problem(train[i]) for i in range(seen)} & scored == set()
