"""ptx.episodes.evaluation: pass@k against the estimator, both drivers (single-turn, episodes), reports and compare."""

import asyncio
import collections
import dataclasses
import fractions
import json
import math

import jax
import pytest
from scripted_episodes import ENGINE, MODEL, ScriptedEnv

from ptx.data.arithmetic import ArithmeticTask
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import init_params
from ptx.episodes import evaluation
from ptx.envs import base, exact_answer, shell
from ptx.episodes.turn_format import TurnFormat
from ptx.sampling import SamplingConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.generation import STOP

FMT = TurnFormat(ByteTokenizer())
# Scripted episodes of 1-3 turns; the steps of task 3 raise (the environment fails, not the model).
TASKS = [{"prompt": f"task {i}", "turns": 1 + i % 3} for i in range(5)]


@pytest.mark.parametrize("n,c,k,expected", [
    (1, 1, 1, 1.0), (1, 0, 1, 0.0), (2, 1, 1, 0.5), (2, 1, 2, 1.0), (5, 2, 2, 0.7), (10, 3, 5, 1 - 21 / 252),
    (200, 0, 100, 0.0), (200, 1, 1, 0.005), (4, 3, 2, 1.0), (8, 1, 4, 0.5),
])
def test_pass_at_k_hand_made_cases(n, c, k, expected):
  # float64 products of at most 100 ratios: a few ulps of 1, far below 1e-12.
  assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n", [1, 7, 64, 500, 3000])
def test_pass_at_k_matches_the_exact_binomial_estimator(n):
  for c in sorted({0, 1, n // 3, n // 2, n - 1, n} & set(range(n + 1))):
    for k in sorted({1, 2, n // 4, n // 2, n} & set(range(1, n + 1))):
      exact = 1 - fractions.Fraction(math.comb(n - c, k), math.comb(n, k))
      # Against exact rationals: up to 3000 float64 factors, each off by half an ulp, stay within 1e-9 relative.
      assert evaluation.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12), (n, c, k)


def test_pass_at_k_rejects_bad_counts():
  with pytest.raises(ValueError, match="k <= n"):
    evaluation.pass_at_k(4, 1, 5)
  with pytest.raises(ValueError, match="c <= n"):
    evaluation.pass_at_k(4, 5, 1)


def _arithmetic_run(correct_per_task, k=4):
  """Task i gets correct_per_task[i] right answers among its k samples."""
  tasks = [ArithmeticTask(seed=1)[i] for i in range(len(correct_per_task))]
  answers = {t["prompt"]: t["answer"] for t in tasks}

  def generate(prompts, n):
    assert n == k
    out = []
    for prompt in prompts:
      c = correct_per_task[list(answers).index(prompt)]
      out.append([answers[prompt]] * c + ["no idea"] + [str(int(answers[prompt]) + 1)] * (k - c - 1)
                 if c < k else [answers[prompt]] * k)
    return [row[:k] for row in out]

  return evaluation.evaluate(generate, exact_answer.ExactAnswerEnv(), tasks, k=k)


def test_evaluate_single_turn_report():
  correct = [0, 1, 2, 4]
  report = _arithmetic_run(correct)
  assert report["tasks"] == 4 and report["k"] == 4 and report["env"] == "exact_answer"
  assert set(report["pass@k"]) == {"1", "2", "4"}
  for j in (1, 2, 4):
    want = sum(evaluation.pass_at_k(4, c, j) for c in correct) / 4
    assert report["pass@k"][str(j)] == pytest.approx(want)  # the same float64 sums in another order: 1e-6 default
  assert report["mean@k"] == pytest.approx(7 / 16)
  assert report["outcomes"] == {"ok": 7, "no_answer": 3, "wrong": 6}
  assert [t["correct"] for t in report["per_task"]] == correct


@pytest.fixture(scope="module")
def params():
  return init_params(MODEL, jax.random.key(0))


def _episodes(params, seed, k=2):
  """The report of k scripted episodes per task on a fresh engine seeded `seed`, and what the engine saw.

  Returns:
    (report, turns: each sequence's Completions, extends: the tokens appended to each sequence, submits: the
    prompts submitted with their sample counts).
  """
  engine = RolloutEngine(MODEL, ENGINE, sampling=SamplingConfig(temperature=1.0), seed=seed)
  turns, extends, submits = collections.defaultdict(list), collections.defaultdict(list), []
  step, extend, submit = engine.step, engine.extend, engine.submit

  def recording_step(*args, **kwargs):
    completions = step(*args, **kwargs)
    for c in completions:
      turns[c.seq_id].append(c)
    return completions

  def recording_extend(seq_id, tokens, **kwargs):
    extends[seq_id].append(list(tokens))
    return extend(seq_id, tokens, **kwargs)

  def recording_submit(prompt, **kwargs):
    submits.append((list(prompt), kwargs["samples"]))
    return submit(prompt, **kwargs)

  engine.step, engine.extend, engine.submit = recording_step, recording_extend, recording_submit
  report = evaluation.evaluate_episodes(engine, params, ScriptedEnv(fail="task 3"), TASKS, FMT, k=k,
                                        max_turn_tokens=6)
  assert engine.allocator.in_use == 0 and not engine.busy  # every episode gave its pages back
  return report, turns, extends, submits


def test_an_evaluated_episode_is_its_sampled_tokens_and_the_encoded_replies(params):
  report, turns, extends, submits = _episodes(params, seed=3)
  # Each task's prompt goes to the engine once, for its k samples together; everything after it is extended.
  assert submits == [(FMT.prompt(t["prompt"]), 2) for t in TASKS]
  assert report["outcomes"] == {"infra_error": 2, "ok": 8} and report["pass@k"] == {"1": 0.8, "2": 0.8}
  assert report["env"] == "scripted" and report["sandbox"] is None and report["mean@k"] == 0.8
  for entry in report["samples"]:
    task = TASKS[entry["task"]]
    seq_id = entry["task"] * 2 + entry["sample"]  # ids go in task, then sample order
    tokens, messages = [], []
    for i, turn in enumerate(turns[seq_id]):
      tokens += turn.tokens.tolist()
      messages.append({"role": "assistant", "content": FMT.action(turn.tokens)})
      if i + 1 < len(turns[seq_id]):
        observation = f"obs {i + 1} of {task['prompt']}"
        reply = FMT.reply([{"role": "user", "content": task["prompt"]}, *messages], observation,
                          closed=turn.finish_reason == STOP)
        assert extends[seq_id][i] == reply  # the reply, encoded once, is what the live sequence got
        tokens += reply
        messages.append({"role": "tool", "content": observation})
    # The report's text is the decoding of exactly those tokens: the sampled ones and the appended replies.
    assert entry["completion"] == FMT.tokenizer.decode(tokens)
    assert entry["messages"] == messages and entry["turns"] == len(turns[seq_id])
    assert entry["turns"] == (1 if task["prompt"] == "task 3" else task["turns"])  # task 3 failed at its first step
    # A scripted observation is one tool call, the second of an episode failed: summed from the steps.
    calls = entry["turns"] - 1 if task["prompt"] != "task 3" else 0
    assert (entry["tool_calls"], entry["tool_errors"]) == (calls, int(calls >= 2))
    assert entry.get("prompt") == (task["prompt"] if entry["sample"] == 0 else None)
  assert "the environment's step raised OSError" in report["per_task"][3]["reasons"][0]


def test_the_same_seed_gives_the_same_episode_report(params):
  first, again, other = (_episodes(params, seed)[0] for seed in (3, 3, 4))
  assert again == first
  # A test that can fail: another seed samples other turns.
  assert [s["completion"] for s in other["samples"]] != [s["completion"] for s in first["samples"]]


def test_episodes_refuse_bad_records_and_counts_by_name(params):
  engine = RolloutEngine(MODEL, ENGINE, seed=0)
  good = {"prompt": "p", "files": {}, "check": "true"}
  with pytest.raises(ValueError, match="task 1: shell task record needs field 'check'"):
    evaluation.evaluate_episodes(engine, params, shell.ShellEnv(), [good, {"prompt": "p", "files": {}}], FMT, k=2,
                                 max_turn_tokens=4)
  for k, tasks, message in ((0, TASKS, "k must be >= 1"), (1, [], "tasks is empty")):
    with pytest.raises(ValueError, match=message):
      evaluation.evaluate_episodes(engine, params, ScriptedEnv(), tasks, FMT, k=k, max_turn_tokens=4)


def test_single_turn_evaluate_refuses_a_multi_turn_environment():
  with pytest.raises(ValueError, match=r"shell is multi-turn \(max_turns 8\): .* evaluate_episodes"):
    evaluation.evaluate(lambda prompts, k: [["DONE"] * k for _ in prompts], shell.ShellEnv(),
                        [{"prompt": "p", "files": {}, "check": "true"}], k=1)


@dataclasses.dataclass(frozen=True)
class BrokenEnv:
  name: str = "broken"
  max_turns: int = 1

  def reset(self, task):
    def score(action):
      raise RuntimeError("verifier bug")
    return base.SingleTurn("p", score)


def test_a_scoring_step_that_raises_is_an_infra_error_not_a_wrong_answer():
  report = evaluation.evaluate(lambda prompts, k: [["x"] * k for _ in prompts], BrokenEnv(), [{}], k=2)
  assert report["outcomes"] == {"infra_error": 2}
  assert "verifier bug" in report["per_task"][0]["reasons"][0]


def test_a_bad_task_record_is_named():
  with pytest.raises(ValueError, match="task 1: exact_answer task record needs field 'answer'"):
    evaluation.evaluate(lambda prompts, k: [["2"] * k for _ in prompts], exact_answer.ExactAnswerEnv(),
                        [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}], k=2)


def test_generate_with_the_wrong_shape_is_rejected():
  with pytest.raises(ValueError, match="wanted 2"):
    evaluation.evaluate(lambda prompts, k: [["x"]], exact_answer.ExactAnswerEnv(),
                        [{"prompt": "1+1=", "answer": "2"}], k=2)


def test_evaluate_works_inside_a_running_event_loop():
  async def notebook_cell():
    return _arithmetic_run([1, 4])

  assert asyncio.run(notebook_cell())["outcomes"]["ok"] == 5


def test_report_round_trip_and_compare(tmp_path):
  a, b = _arithmetic_run([2, 4, 4, 1]), _arithmetic_run([2, 4, 0, 1])
  evaluation.write_report(a, tmp_path / "a.json")
  evaluation.write_report(b, tmp_path / "b.json")
  a2, b2 = evaluation.read_report(tmp_path / "a.json"), evaluation.read_report(tmp_path / "b.json")
  assert a2 == {k: v for k, v in a.items() if k != "samples"}
  table = evaluation.compare(a2, b2)
  lines = {line.split()[0] + (" " + line.split()[1] if line.startswith("rate") else ""): line
           for line in table.splitlines()[2:]}
  assert "REGRESSION" in lines["pass@1"] and "REGRESSION" in lines["mean@k"] and "REGRESSION" in lines["rate ok"]
  assert "REGRESSION" not in lines["rate wrong"]
  assert "REGRESSION" not in evaluation.compare(a2, a2)
  assert "REGRESSION" not in evaluation.compare(b2, a2)
  (tmp_path / "bad.json").write_text("{}")
  with pytest.raises(ValueError, match="lacks 'pass@k'"):
    evaluation.read_report(tmp_path / "bad.json")


def test_every_completion_is_written_to_samples_jsonl_beside_the_report(tmp_path):
  report = _arithmetic_run([0, 1], k=2)
  evaluation.write_report(report, tmp_path / "eval.json")
  samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
  tasks = [ArithmeticTask(seed=1)[i] for i in range(2)]
  answers = [t["answer"] for t in tasks]
  assert samples == [
      {"task": 0, "sample": 0, "reward": 0.0, "outcome": "no_answer", "reason": samples[0]["reason"],
       "prompt": tasks[0]["prompt"], "completion": "no idea"},
      {"task": 0, "sample": 1, "reward": 0.0, "outcome": "wrong", "reason": samples[1]["reason"],
       "completion": str(int(answers[0]) + 1)},
      {"task": 1, "sample": 0, "reward": 1.0, "outcome": "ok", "reason": samples[2]["reason"],
       "prompt": tasks[1]["prompt"], "completion": answers[1]},
      {"task": 1, "sample": 1, "reward": 0.0, "outcome": "no_answer", "reason": samples[3]["reason"],
       "completion": "no idea"}]
  assert [s["reason"] for s in samples] == [r for t in report["per_task"] for r in t["reasons"]]
  assert "samples" not in json.loads((tmp_path / "eval.json").read_text())


def test_a_report_that_fails_to_write_leaves_the_earlier_files_whole(tmp_path):
  evaluation.write_report(_arithmetic_run([1]), tmp_path / "eval.json")
  before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
  broken = {**_arithmetic_run([2]), "cells": {"x": object()}}  # not JSON: fails while the summary is made
  with pytest.raises(TypeError, match="not JSON serializable"):
    evaluation.write_report(broken, tmp_path / "eval.json")
  assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
  assert sorted(before) == ["eval.json", "samples.jsonl"]  # and no temporary file is left


def test_a_drop_of_pass_at_1_beyond_the_threshold_is_a_regression():
  def at(p):
    return {"pass@k": {"1": p}}

  assert evaluation.regressed(at(0.5), at(0.25), 0.05) and not evaluation.regressed(at(0.25), at(0.5), 0.05)
  # 0.5 - 0.45 is 0.05000000000000002 in float64: a drop equal to the threshold is not beyond it.
  assert not evaluation.regressed(at(0.5), at(0.45), 0.05) and evaluation.regressed(at(0.5), at(0.44), 0.05)
  assert not evaluation.regressed(at(0.5), at(0.5), 0.0)


def test_suite_directories_round_trip_and_compare_per_suite(tmp_path):
  before = {"arithmetic": {"suite": "arithmetic", **_arithmetic_run([2, 4, 4, 1])},
            "countdown": {"suite": "countdown", **_arithmetic_run([1, 1])}, "needle": _arithmetic_run([1])}
  after = {"arithmetic": {"suite": "arithmetic", **_arithmetic_run([2, 4, 0, 1])},
           "countdown": {"suite": "countdown", **_arithmetic_run([1, 2, 3])}, "math": _arithmetic_run([4])}
  evaluation.write_suites(before, tmp_path / "a")
  evaluation.write_suites(after, tmp_path / "b")
  assert sorted(p.name for p in (tmp_path / "a" / "arithmetic").iterdir()) == ["eval.json", "samples.jsonl"]
  a, b = evaluation.read_suites(tmp_path / "a"), evaluation.read_suites(tmp_path / "b")
  assert a == {name: {k: v for k, v in r.items() if k != "samples"} for name, r in before.items()}
  table, worse = evaluation.compare_suites(a, b, threshold=0.05)
  assert worse == ["arithmetic"]  # pass@1 0.6875 -> 0.4375; countdown's rose (0.25 -> 0.5)
  rows = {tuple(line.split()[:2]): line for line in table.splitlines()[1:] if line.split()[0] in before}
  assert rows["arithmetic", "pass@1"].split()[2:] == ["0.6875", "0.4375", "-0.2500", "REGRESSED"]
  assert rows["arithmetic", "pass@4"].split()[2:] == ["1.0000", "0.7500", "-0.2500"]  # flagged by pass@1 only
  assert rows["countdown", "mean@k"].split()[2:] == ["0.2500", "0.5000", "+0.2500"]
  assert "NOTE: countdown: A has 2 tasks x 4, B 3 x 4" in table and "only in A: needle" in table
  assert "only in B: math" in table and table.splitlines()[-1] == (
      "REGRESSED (pass@1 fell by more than 0.05): arithmetic")
  assert evaluation.compare_suites(a, b, threshold=0.25)[1] == []
  # A single report reads as the suite it names; one directory holding eval.json as that report.
  (tmp_path / "one").mkdir()
  evaluation.write_report(before["arithmetic"], tmp_path / "one" / "eval.json")
  assert evaluation.read_suites(tmp_path / "one") == evaluation.read_suites(tmp_path / "one" / "eval.json") == {
      "arithmetic": a["arithmetic"]}
  with pytest.raises(ValueError, match="share no suite"):
    evaluation.compare_suites({"math": a["needle"]}, a, threshold=0.05)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="holds no evaluation report"):
    evaluation.read_suites(tmp_path / "empty")
  with pytest.raises(ValueError, match="no such report"):
    evaluation.read_suites(tmp_path / "missing")
