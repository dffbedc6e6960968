"""ptx.envs.suites: generated and file suites load, evaluate and are labelled."""

import json

import pytest

from ptx.config import EvalConfig
from ptx.data.tokenizer import ByteTokenizer
from ptx.episodes import evaluation
from ptx.envs import suites
from ptx.envs.calculator import CalculatorTasks
from ptx.envs.docqa import DocQATasks
from ptx.envs.terminal import TerminalTasks
from ptx.train import checkpoint_evals

TOK = ByteTokenizer()


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "calculator", "terminal", "docqa"])
def test_generated_suites_are_seeded(name):
  env, tasks = suites.load(name, n=5, seed=2, tokenizer=TOK)
  assert len(tasks) == 5 and tasks == suites.load(name, n=5, seed=2, tokenizer=TOK)[1]
  assert tasks != suites.load(name, n=5, seed=3, tokenizer=TOK)[1]
  assert env.reset(tasks[0]).prompt
  # Played as episodes on the engine.
  assert (env.max_turns > 1) == (name in ("calculator", "terminal", "docqa"))
  if name == "terminal":
    env.reset(tasks[0]).close()  # a workspace: give it back


def test_the_episode_suites_are_the_held_out_splits():
  # A suite draws the held-out side of the task's split: none of its problems is one the training stream poses.
  train = {CalculatorTasks(seed=0)[i]["prompt"] for i in range(400)}
  _, tasks = suites.load("calculator", n=100)
  assert tasks == [CalculatorTasks(seed=0, split="held_out")[i] for i in range(100)]
  assert not train & {t["prompt"] for t in tasks}
  # Terminal tasks split by variant (bug family and theme): the suite's variants are none of training's.
  _, tasks = suites.load("terminal", n=40)
  assert tasks == [TerminalTasks(seed=0, split="held_out")[i] for i in range(40)]
  held_out = {TerminalTasks(seed=0, split="held_out").variant(i) for i in range(40)}
  assert not held_out & {TerminalTasks(seed=0).variant(i) for i in range(200)}
  # docqa splits by document: no question of the suite is about a document training reads.
  _, tasks = suites.load("docqa", n=20, tokenizer=TOK)
  assert tasks == [DocQATasks(seed=0, split="held_out")[i] for i in range(20)]
  assert not {t["doc"] for t in tasks} & {DocQATasks(seed=0)[i]["doc"] for i in range(200)}


def test_math_file_suite_evaluates(tmp_path):
  path = tmp_path / "math.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"{i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(3)))
  env, tasks = suites.load("math", n=10, path=path)
  assert len(tasks) == 3 and env.reset(tasks[0]).prompt.endswith("\\boxed{}.")
  report = evaluation.evaluate(lambda prompts, k: [[f"\\boxed{{{2 * int(p.split('+')[0])}}}"] * k for p in prompts],
                               env, tasks, k=2)
  assert report["pass@k"] == {"1": 1.0, "2": 1.0}


def test_bad_names_and_missing_paths_are_explained():
  with pytest.raises(ValueError, match="known: arithmetic"):
    suites.load("nope")
  with pytest.raises(ValueError, match="pass path"):
    suites.load("code")
  with pytest.raises(ValueError, match="'docqa' needs the policy's tokenizer"):
    suites.load("docqa")


def test_evaluation_sizes_docqa_episodes_for_its_replies():
  # docqa's replies run to its reply_tokens (512, passages shown whole), past the 256 a shell's output gets: an
  # evaluated episode has room for every turn and every reply at that size, so none ends at the context's edge.
  (_, env, _), = checkpoint_evals.build(EvalConfig(suites=("docqa",), n=1, max_new_tokens=8), TOK).suites
  calculator = suites.load("calculator", n=1)[0]
  assert env.reply_tokens == 512 and env.max_turns == 6
  assert checkpoint_evals.episode_tokens(env, 8) == 6 * 8 + 5 * 512
  assert checkpoint_evals.episode_tokens(calculator, 8) == 4 * 8 + 3 * 256
  assert checkpoint_evals.episode_tokens(calculator, 300) == 4 * 300 + 3 * 300


def _no_idea(prompts, k):
  return [["no idea"] * k for _ in prompts]


def test_a_suite_report_names_its_suite_and_needle_reads_per_cell():
  env, tasks = suites.load("arithmetic", n=2)
  report = suites.label("arithmetic", env, tasks, evaluation.evaluate(_no_idea, env, tasks, k=2))
  assert report["suite"] == "arithmetic" and report["tasks"] == 2 and "cells" not in report
  assert report["answer_match"] == "math"
  env, tasks = suites.load("needle", n=3)
  report = suites.label("needle", env, tasks, evaluation.evaluate(_no_idea, env, tasks, k=1))
  want = {(str(t["length"]), str(t["depth"])) for t in tasks}
  got = {(length, depth): v for length, row in report["cells"].items() for depth, v in row.items()}
  assert report["suite"] == "needle" and set(got) == want and set(got.values()) == {0.0}


def test_the_exact_suite_matches_words_when_asked_and_says_so(tmp_path):
  path = tmp_path / "capitals.jsonl"
  path.write_text('{"prompt": "Capital of France?", "answer": "Paris"}\n'
                  '{"prompt": "Capital of Italy?", "answer": "Rome"}\n')
  replies = {"Capital of France?": "Paris.", "Capital of Italy?": "Rome!"}

  def say(prompts, k):
    return [[replies[p]] * k for p in prompts]

  for match, passed in (("math", 0.0), ("text", 1.0)):
    env, tasks = suites.load("exact", n=2, path=path, answer_match=match)
    report = suites.label("exact", env, tasks, evaluation.evaluate(say, env, tasks, k=1))
    assert report["answer_match"] == match and report["pass@k"]["1"] == passed, report


def test_the_bfcl_suite_is_its_held_out_split_called_in_the_policys_form():
  pytest.importorskip("bfcl_eval")  # a --no-deps fixture `make test` installs
  from ptx.envs import bfcl
  from ptx.envs.tools import render_calls

  with pytest.raises(ValueError, match="needs the policy's tokenizer"):
    suites.load("bfcl", n=2)
  env, tasks = suites.load("bfcl", n=1000, tokenizer=TOK)
  assert env.tool_format == "hermes" and len(tasks) == len(bfcl.BFCLTasks(split="held_out")) == 252
  train = bfcl.BFCLTasks(split="train")
  assert {t["id"] for t in tasks}.isdisjoint(train[i]["id"] for i in range(len(train)))
  replies = {t["id"]: render_calls("hermes", bfcl.ground_truth(t)) for t in tasks[:8]}

  def call(prompts, k):
    return [[replies[t["id"]]] * k for t in tasks[:8]]

  report = suites.label("bfcl", env, tasks[:8], evaluation.evaluate(call, env, tasks[:8], k=1))
  assert report["pass@k"]["1"] == 1.0, report["per_task"]
