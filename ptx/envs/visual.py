"""Visual questions: an image and a question with one exact answer, as a multimodal chat record, and their environment.

A record is the chat format of `ptx.data.image_chat` (which renders and tiles the image) plus the answer:

  {"prompt": [{"role": "user", "content": [{"type": "image", "bytes": <base64 PNG>},
                                           {"type": "text", "text": QUESTION}]}],
   "answer": "9:20", "answer_kind": "time", "family": "clock", "identity": "clock 9:20"}

`VisualTasks(generator, seed, split)[i]` is a pure function of (seed, i, split), like
`ptx.envs.countdown.CountdownTask`: the generator (`ptx.envs.visual_tasks`, `ptx.envs.handwritten_digits`) draws
one problem of its side of the train / held-out split. "identity" names the problem the split is decided on.

`VisualEnv` scores one reply: the answer it states (`ptx.verifiers.text_answer.extract`: boxed, after "answer is",
else its last non-empty line), in the one written form of the record's answer kind, equal to the answer's:

  number  ASCII digits ("07" is 7); Unicode compatibility forms fold first (NFKC: fullwidth "３" is 3), other
          scripts' digits ("٣") and anything around the digits ("3 circles", "2 or 3") are no number
  label   one word of letters, any case ("f" is "F")
  time    H:MM with H in 1..12, spaces around ":" and a leading zero allowed ("09 : 20" is 9:20; "9.20" is not)

A stated answer may end with a full stop. No answer (an empty reply, an empty box) scores NO_ANSWER; an answer not
in the kind's form, or another one, WRONG.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import re
import unicodedata
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import numpy as np
from PIL import Image

from ptx.data import image_chat, splits
from ptx.envs.base import Outcome, SingleTurn, Step, field
from ptx.verifiers import text_answer

ANSWER_KINDS = ("number", "label", "time")
# Appended to every question: the box is where `text_answer.extract` looks first.
INSTRUCTION = " Put the final answer in \\boxed{}."
_FORMS = {"number": "a number", "label": "one word", "time": "a time H:MM"}
_NUMBER = re.compile(r"[0-9]+")  # ASCII: a str pattern's \d would take any script's digits
_LABEL = re.compile(r"[a-z]+")
_TIME = re.compile(r"([0-9]{1,2})\s*:\s*([0-9]{2})")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One drawn visual question."""

  image: Image.Image  # RGB
  question: str  # what is asked, with the answer's form where it has one ("Answer as H:MM.")
  answer: str  # in its kind's written form (`canonical`)
  kind: str  # one of ANSWER_KINDS
  identity: str  # names the problem (what the split is decided on; the digit images for handwritten digits)


class Generator(Protocol):
  """Draws the problems of one family."""

  family: ClassVar[str]  # the records' "family"

  def draw(self, rng: np.random.Generator, split: str) -> Problem:
    """One problem of `split` ("train" or "held_out"), from `rng` alone."""


@dataclasses.dataclass(frozen=True)
class VisualTasks:
  """Seeded visual problems of one generator as records.

  Attributes:
    generator: draws the problems (its fields are the difficulty knobs).
    seed: selects the stream of problems.
    split: "train" (training streams) or "held_out" (evaluation sets).
  """

  generator: Generator
  seed: int = 0
  split: str = "train"

  def __post_init__(self):
    splits.check("VisualTasks", self.split)

  def __getitem__(self, index: int) -> dict[str, Any]:
    """Returns the record of problem `index`."""
    if index < 0:
      raise IndexError(f"VisualTasks index must be >= 0, got {index}")
    return record(self.generator.draw(np.random.default_rng([self.seed, index]), self.split), self.generator.family)


def record(problem: Problem, family: str) -> dict[str, Any]:
  """`problem` as a record of the module docstring: its image a base64 PNG part before the question."""
  png = io.BytesIO()
  problem.image.save(png, format="PNG")
  content = [{"type": "image", "bytes": base64.b64encode(png.getvalue()).decode("ascii")},
             {"type": "text", "text": problem.question + INSTRUCTION}]
  return {"prompt": [{"role": "user", "content": content}], "answer": problem.answer, "answer_kind": problem.kind,
          "family": family, "identity": problem.identity}


def canonical(answer: str, kind: str) -> str | None:
  """`answer` in the one written form of `kind` (module docstring), or None when it is not one answer of that kind."""
  text = unicodedata.normalize("NFKC", answer).strip().removesuffix(".").strip()
  if kind == "number":
    return str(int(text)) if _NUMBER.fullmatch(text) else None
  if kind == "label":
    return text.lower() if _LABEL.fullmatch(text.lower()) else None
  match = _TIME.fullmatch(text)
  if match is None or not 1 <= int(match[1]) <= 12 or int(match[2]) > 59:
    return None
  return f"{int(match[1])}:{match[2]}"


def score(reply: str, answer: str, kind: str) -> Step:
  """Scores a reply to a visual question.

  Args:
    reply: the model's text.
    answer: the right answer, in `kind`'s form.
    kind: one of ANSWER_KINDS.

  Returns:
    The final Step.
  """
  said = text_answer.extract(reply)
  if said is None or not said.strip():
    return Step.final(Outcome.NO_ANSWER, "no answer found")
  written = canonical(said, kind)
  if written is None:
    return Step.final(Outcome.WRONG, f"{said!r} is not {_FORMS[kind]}")
  if written != canonical(answer, kind):
    return Step.final(Outcome.WRONG, f"{said!r} is not {answer!r}")
  return Step.final(Outcome.OK, f"{said!r} is {answer!r}")


@dataclasses.dataclass(frozen=True)
class VisualEnv:
  """Single-turn visual questions on the records of the module docstring."""

  name: str = "visual"
  max_turns: int = 1
  sandboxed: bool = False

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks a record's prompt (chat messages holding an image), "answer" and "answer_kind"."""
    self._question(task)
    self._answer(task)

  def reset(self, task: Mapping[str, Any]) -> SingleTurn:
    """Starts an episode whose prompt is the question's text (the image is the record's to render)."""
    question = self._question(task)
    answer, kind = self._answer(task)
    return SingleTurn(question, lambda action: score(action, answer, kind))

  def _question(self, task: Mapping[str, Any]) -> str:
    """The text parts of the last user message, the prompt checked to hold an image."""
    messages = field(task, "prompt", list, self.name)
    try:
      image_chat.validate(messages)
    except ValueError as e:
      raise ValueError(f"{self.name} task field 'prompt': {e}") from None
    parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"]]
    if not any(p["type"] == "image" for p in parts):
      raise ValueError(f"{self.name} task field 'prompt' holds no image part")
    user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    return user if isinstance(user, str) else " ".join(p["text"] for p in user if p["type"] == "text")

  def _answer(self, task: Mapping[str, Any]) -> tuple[str, str]:
    kind = field(task, "answer_kind", str, self.name)
    if kind not in ANSWER_KINDS:
      raise ValueError(f"{self.name} task field 'answer_kind' must be one of {ANSWER_KINDS}, got {kind!r}")
    answer = field(task, "answer", str, self.name)
    if canonical(answer, kind) is None:
      raise ValueError(f"{self.name} task field 'answer' must be {_FORMS[kind]} (answer_kind {kind!r}), got {answer!r}")
    return answer, kind
