"""Word answers: the answer a reply states, matched to references by normalised string equality.

For questions whose answer is a word or a phrase ("What is the capital of France?" -> "Paris"), where math
extraction (the last number) and symbolic equality do not apply. The answer is the one the reply states
(`ptx.verifiers.math_answer.stated_answer`: boxed, after `####`, after "answer is" or "answer:"), else its last
non-empty line. Both sides are normalised as SQuAD's and TriviaQA's exact match does: lower case, punctuation
and the articles a, an, the removed, whitespace collapsed. A reference may list aliases; any one matches.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Sequence

from ptx.verifiers import math_answer

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
  """Returns `text` lower-cased (Unicode-normalised), without punctuation or articles, whitespace collapsed."""
  text = unicodedata.normalize("NFKC", text).lower().translate(_PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", text).split())


def extract(text: str) -> str | None:
  """Returns the answer a reply states, else its last non-empty line; None for neither or an unfinished one.

  Args:
    text: the model's reply.

  Returns:
    The answer, not yet normalised.
  """
  if math_answer.states_answer(text):  # a box left open is no answer, not the last line
    return math_answer.stated_answer(text)
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  return lines[-1] if lines else None


def matches(answer: str, references: Sequence[str]) -> bool:
  """Whether `answer` equals one of `references` once both are normalised (an empty normal form matches nothing)."""
  said = normalize(answer)
  return bool(said) and any(said == normalize(reference) for reference in references)
