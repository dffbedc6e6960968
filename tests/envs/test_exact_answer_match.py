"""ExactAnswerEnv's two answer modes: math (the default) and words (`match="text"`), and the text normaliser."""

import pytest

from ptx.envs.base import Outcome
from ptx.envs.exact_answer import ExactAnswerEnv
from ptx.verifiers import text_answer

CAPITAL = {"prompt": "What is the capital of France?", "answer": "Paris"}


def _score(env, task, reply):
  return env.reset(task).step(reply)


def test_math_mode_finds_no_answer_in_a_word_reply_and_text_mode_does():
  """The issue's case: "Paris" was "no final answer found" under math extraction."""
  assert _score(ExactAnswerEnv(), CAPITAL, "Paris").outcome == Outcome.NO_ANSWER
  text = ExactAnswerEnv(match="text")
  for reply in ("Paris", "paris.", "The answer is Paris.", "Let me think.\nAnswer: PARIS", "\\boxed{Paris}",
                "I recall the capital.\nParis!"):
    assert _score(text, CAPITAL, reply).outcome == Outcome.OK, reply


@pytest.mark.parametrize("reply,outcome", [
    ("Lyon", Outcome.WRONG),
    ("The capital of France is Paris.", Outcome.WRONG),  # exact match: the answer must be stated, not buried in prose
    ("Paris or Lyon", Outcome.WRONG),  # hedging between candidates is not the answer
    ("", Outcome.NO_ANSWER),
    ("\\boxed{Par", Outcome.NO_ANSWER),  # stopped inside its box
    ("The answer is the.", Outcome.WRONG),  # nothing left once normalised: matches nothing
])
def test_text_mode_refuses_what_is_not_the_answer(reply, outcome):
  assert _score(ExactAnswerEnv(match="text"), CAPITAL, reply).outcome == outcome


def test_aliases_and_normalisation():
  task = {"prompt": "Who wrote Hamlet?", "answer": ["William Shakespeare", "Shakespeare"]}
  env = ExactAnswerEnv(match="text")
  assert _score(env, task, "Answer: shakespeare").outcome == Outcome.OK
  assert _score(env, task, "William  Shakespeare").outcome == Outcome.OK
  assert text_answer.normalize("  The Eiffel-Tower!  ") == "eiffeltower"
  assert text_answer.normalize("Ｐａｒｉｓ") == "paris"  # full-width letters (NFKC)
  assert not text_answer.matches("", ["Paris"])


def test_records_are_checked_by_mode():
  with pytest.raises(ValueError, match="match must be one of"):
    ExactAnswerEnv(match="words")
  with pytest.raises(ValueError, match="'answer' must be str, int or float"):
    ExactAnswerEnv().validate({"prompt": "p", "answer": ["a"]})  # aliases are words, not math
  with pytest.raises(ValueError, match="non-empty list of str"):
    ExactAnswerEnv(match="text").validate({"prompt": "p", "answer": []})
  with pytest.raises(ValueError, match="non-empty list of str"):
    ExactAnswerEnv(match="text").validate({"prompt": "p", "answer": "The"})  # an article alone normalises to ""


def test_math_mode_is_unchanged():
  env = ExactAnswerEnv()
  task = {"prompt": "2+2?", "answer": "4"}
  assert _score(env, task, "so 2+2 = 4").outcome == Outcome.OK
  assert _score(env, task, "Answer: 4.0").outcome == Outcome.OK
  assert _score(env, task, "\\boxed{5}").outcome == Outcome.WRONG
  assert _score(env, task, "\\boxed{4").outcome == Outcome.NO_ANSWER
