"""Finds the final answer in a model's math solution.

Looked for in this order: the last `\\boxed{...}` (or `\\fbox{...}`), the text after
the last GSM8K `####`, the text after the last "answer is" or "answer:", and finally the last
number in the text. Nested braces inside `\\boxed{}` are kept whole; a box left
unclosed (a truncated solution) means no answer.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_BOX = re.compile(r"\\(?:boxed|fbox)")
_ANSWER_IS = re.compile(r"answer(?: is|:)[:\s]*(\$[^$]+\$|[^\n]+)", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
  """Returns the contents of the last `\\boxed{...}` / `\\fbox{...}`, or None.

  Args:
    text: a solution.

  Returns:
    The contents, braces balanced; `\\boxed 5` (no braces) gives "5".
  """
  boxes = list(_BOX.finditer(text))
  if not boxes:
    return None
  i = boxes[-1].end()
  if text[i:i + 1] == " ":
    match = re.match(r" *([^\s$]+)", text[i:])
    return match.group(1) if match else None
  if text[i:i + 1] != "{":
    return None
  depth = 0
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i + 1:j]
  return None  # unbalanced: the model stopped mid-answer


def states_answer(text: str) -> bool:
  """Whether a solution marks an answer (a box, `####`, "answer is"), even one it did not finish."""
  return bool(_BOX.search(text)) or "####" in text or bool(_ANSWER_IS.search(text))


def stated_answer(text: str) -> str | None:
  """Returns the answer a solution states as its answer (boxed, after `####`, after "answer is"), or None.

  Args:
    text: the model's solution.

  Returns:
    The answer text, not yet normalised; None when the text states none (or stopped inside its box).
  """
  if _BOX.search(text):
    boxed = last_boxed(text)  # None when the model stopped inside the box
    return None if boxed is None else boxed.strip()
  if "####" in text:
    tail = text.rsplit("####", 1)[1].strip().splitlines()
    return tail[0].strip() if tail else None
  said = _ANSWER_IS.findall(text)
  return said[-1].strip().strip("$").rstrip(".").strip() if said else None


def extract_answer(text: str) -> str | None:
  """Returns the final answer of a math solution: the stated one (`stated_answer`), else its last number, else None.

  Args:
    text: the model's solution.

  Returns:
    The answer text, not yet normalised.
  """
  if states_answer(text):  # a box left open or an empty `####` is no answer, not the last number
    return stated_answer(text)
  numbers = _NUMBER.findall(text)
  return numbers[-1].rstrip(",") if numbers else None
