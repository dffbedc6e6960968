"""ptx.envs.visual: one reply scored by its exact answer, against the answer-format hacks a policy would try."""

import re

import pytest

from ptx.data import splits
from ptx.envs import handwritten_digits, suites
from ptx.envs.base import Outcome
from ptx.envs.handwritten_digits import DigitSums
from ptx.envs.visual import VisualEnv, VisualTasks, canonical, score
from ptx.envs.visual_tasks import GENERATORS
from ptx.episodes import evaluation
from ptx.verifiers import math_answer, text_answer

OK, WRONG, NO_ANSWER = Outcome.OK, Outcome.WRONG, Outcome.NO_ANSWER


def _said(reply: str) -> str:
  return text_answer.extract(reply) or ""


# Deliberately lax scorers, each a mistake a reward function could make: every case below is judged wrongly by the
# one it names, so the case can fail.
LAX = {
    # The answer appears somewhere in the reply.
    "contains": lambda reply, answer: answer in re.findall(r"[\w:]+", reply),
    # The boxed answer, or the last number when the box is missing, empty or unclosed.
    "box_or_last_number": lambda reply, answer: (math_answer.last_boxed(reply) or
                                                 (re.findall(r"\d+", reply) or [""])[-1]) == answer,
    # The stated answer is part of the reference.
    "substring": lambda reply, answer: _said(reply).strip() in answer,
    # The stated answer's integer value (Python's int() reads any script's digits).
    "int_value": lambda reply, answer: _said(reply).strip().isdigit() and int(_said(reply)) == int(answer),
    # Word-answer normalisation: punctuation dropped, so "9.20" and "920" read as "9:20".
    "punctuation_blind": lambda reply, answer: text_answer.normalize(_said(reply)) == text_answer.normalize(answer),
    # Raw string equality of the stated answer: refuses the variants that should count.
    "raw": lambda reply, answer: _said(reply) == answer,
}

QUESTION = "How many cells are filled in row 2 (counting from the top)?"
CASES = [  # (what, reply, answer, kind, outcome, the lax scorer that misjudges it)
    ("candidates", "2 or 3", "3", "number", WRONG, "box_or_last_number"),
    ("boxed candidates", "\\boxed{2 or 3}", "3", "number", WRONG, "contains"),
    ("a list", "2, 3, 4", "3", "number", WRONG, "contains"),
    ("a list without spaces", "\\boxed{2,3}", "23", "number", WRONG, "punctuation_blind"),
    ("a ramble", "I see 4 shapes, 2 green and 3 red, so 5 in all, or maybe 3 if only circles count", "3",
     "number", WRONG, "box_or_last_number"),
    ("the question echoed", QUESTION.replace("How many cells are filled in r", "R"), "2", "number", WRONG,
     "contains"),
    ("empty", "", "3", "number", NO_ANSWER, "substring"),
    ("whitespace", "  \n\t ", "3", "number", NO_ANSWER, "substring"),
    ("an empty box", "\\boxed{}", "3", "number", NO_ANSWER, "substring"),
    ("an empty box after the count", "There are 3 green circles. \\boxed{}", "3", "number", NO_ANSWER,
     "box_or_last_number"),
    ("an unclosed box", "so \\boxed{3", "3", "number", NO_ANSWER, "box_or_last_number"),
    ("a prefix of the answer", "\\boxed{1}", "12", "number", WRONG, "substring"),
    ("other script's digits", "\\boxed{٣}", "3", "number", WRONG, "int_value"),
    ("fullwidth digits count", "\\boxed{３}", "3", "number", OK, "raw"),
    ("a leading zero counts", "\\boxed{07}", "7", "number", OK, "raw"),
    ("a final full stop counts", "12.", "12", "number", OK, "raw"),
    ("a zero-padded hour counts", "\\boxed{09:20}", "9:20", "time", OK, "raw"),
    ("spaces around the colon count", "The answer is 9 : 20.", "9:20", "time", OK, "raw"),
    ("a full stop for the colon", "\\boxed{9.20}", "9:20", "time", WRONG, "punctuation_blind"),
    ("no colon", "\\boxed{920}", "9:20", "time", WRONG, "punctuation_blind"),
    ("the letter in another case counts", "\\boxed{f}", "F", "label", OK, "raw"),
    ("the letter inside words", "\\boxed{Bar F}", "F", "label", WRONG, "contains"),
]


@pytest.mark.parametrize("what, reply, answer, kind, outcome, lax", CASES, ids=[c[0] for c in CASES])
def test_hacks_score_nothing_and_honest_variants_count(what, reply, answer, kind, outcome, lax):
  step = score(reply, answer, kind)
  assert step.outcome == outcome and step.reward == (1.0 if outcome == OK else 0.0), step.reason
  # The lax scorer it names gets this case wrong: against it, the assertion above would fail.
  assert LAX[lax](reply, answer) != (outcome == OK)


def test_every_lax_scorer_is_caught():
  assert {case[-1] for case in CASES} == set(LAX)


def test_a_right_answer_scores_in_every_kind_and_a_wrong_one_does_not():
  for answer, kind, wrong in (("3", "number", "4"), ("F", "label", "E"), ("12:05", "time", "12:50")):
    assert score(f"Let me look. \\boxed{{{answer}}}", answer, kind).outcome == OK
    assert score(f"The answer is {answer}", answer, kind).outcome == OK
    assert score(answer, answer, kind).outcome == OK  # the last line alone
    assert score(f"\\boxed{{{wrong}}}", answer, kind).outcome == WRONG


def test_canonical_forms():
  assert [canonical(t, "time") for t in ("12:00", "0:15", "13:00", "9:60", "9:5")] == ["12:00", None, None, None, None]
  assert [canonical(t, "number") for t in ("0", "-3", "3.0", "1 000", "𝟑")] == ["0", None, None, None, "3"]
  assert [canonical(t, "label") for t in ("A", "a.", "A1", "")] == ["a", "a", None, None]


def _record(**fields):
  content = [{"type": "image", "bytes": "iVBORw0KGgo="}, {"type": "text", "text": "How many?"}]
  return {"prompt": [{"role": "user", "content": content}], "answer": "3", "answer_kind": "number", **fields}


def test_bad_records_are_refused_naming_the_field():
  env = VisualEnv()
  assert env.reset(_record()).prompt == "How many?"
  for record, message in (
      (_record(answer_kind="colour"), "'answer_kind' must be one of"),
      (_record(answer="three"), "'answer' must be a number"),
      (_record(answer=3), "'answer' must be str"),
      (_record(answer="9:20", answer_kind="number"), "'answer' must be a number"),
      (_record(prompt="How many?"), "'prompt' must be list"),
      (_record(prompt=[{"role": "user", "content": [{"type": "text", "text": "How many?"}]}]), "no image part"),
      (_record(prompt=[{"role": "user", "content": [{"type": "image"}]}]), "'prompt': messages\\[0\\].content\\[0\\]"),
  ):
    with pytest.raises(ValueError, match=f"visual task .*{message}"):
      env.validate(record)


VISUAL_SUITES = {f"visual_{family}": make for family, make in {**GENERATORS, "digit_sums": DigitSums}.items()}


def _wrong(answer: str, kind: str) -> str:
  """Another answer of the same kind."""
  if kind == "time":
    hour, minute = answer.split(":")
    return f"{int(hour) % 12 + 1}:{minute}"
  return "Z" if kind == "label" else str(int(answer) + 1)


@pytest.mark.parametrize("name", sorted(VISUAL_SUITES))
def test_each_visual_suite_is_held_out_and_scores_right_and_wrong_replies(name):
  env, tasks = suites.load(name, n=4, seed=1)
  assert tasks == [VisualTasks(VISUAL_SUITES[name](), 1, "held_out")[i] for i in range(4)]
  if name == "visual_digit_sums":
    shown = {int(k) for t in tasks for k in t["identity"].split()[1].split(",")}
    assert shown <= set(handwritten_digits.indices("held_out"))
  else:
    assert {splits.split_of(t["identity"]) for t in tasks} == {"held_out"}

  def rewards(answer):
    out = []
    for t in tasks:
      episode = env.reset(t)
      try:
        out.append(episode.step(f"So it is \\boxed{{{answer(t)}}}").reward)
      finally:
        episode.close()
    return out

  assert rewards(lambda t: t["answer"]) == [1.0] * 4
  assert rewards(lambda t: _wrong(t["answer"], t["answer_kind"])) == [0.0] * 4
  # Sampling takes text prompts only so far: evaluating would score a model that never saw the image.
  with pytest.raises(ValueError, match="task 0's prompt holds content parts"):
    evaluation.evaluate(lambda prompts, k: [[""] * k for _ in prompts], env, tasks, k=1)
