"""Arithmetic word problems with a calculator tool: hard to do in one's head, easy with the tool.

Task records are `{"prompt": str, "answer": int, "expression": str}` (the
prompt may be chat messages of one user turn, `ptx.envs.base.user_turn`);
`CalculatorTasks(seed, split)[i]` generates them (three-operation problems
over three- and four-digit numbers; "expression" is the problem's arithmetic,
which only demonstrations read), each side of the train / held-out split by
the problem's identity (`ptx.data.splits`), so a training stream never holds
a held-out problem. In each turn the model either calls the calculator (in
its family's tool-call format, `ptx.envs.tools`) and sees the results, or
answers with `Answer: <integer>`, which ends the episode: reward 1.0 when it
equals the task's answer. A turn with neither gets a reminder; the episode
ends unanswered at `max_turns`.

What the reward cannot be fooled by: only a turn without tool calls can
answer, and it must hold exactly one `Answer:` (a turn listing several is
wrong); the calculator evaluates arithmetic only (numbers, + - * / // % **
and parentheses, bounded in size), never names, attributes or calls, so it
cannot reach the task's answer or anything else in the process.

`CalculatorEnv.demonstration(task)` is a solved episode as chat messages (the
prompt, a calculator call, its result, the answer), played through the
environment itself, for warming a model up on the tool by SFT.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ptx.data import splits
from ptx.envs.base import Outcome, Step, field, user_turn
from ptx.envs.tools import Call, Tool, ToolRegistry, render_calls

_ANSWER = re.compile(r"Answer:\s*(-?\d[\d,]*)")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_MAGNITUDE = 10 ** 30  # of any intermediate result: no expression can take the host's time or memory
_MAX_EXPONENT = 64
_MAX_CHARS = 200


def calculate(expression: str) -> str:
  """The value of an arithmetic expression, as text (integers exactly, floats to 12 significant digits).

  Raises:
    ValueError: for anything but numbers, + - * / // % ** and parentheses,
      division by zero, or values beyond 1e30 (exponents beyond 64).
  """
  if len(expression) > _MAX_CHARS:
    raise ValueError(f"the expression is longer than {_MAX_CHARS} characters")
  try:
    tree = ast.parse(expression.strip(), mode="eval").body
  except SyntaxError as e:
    raise ValueError(f"not an arithmetic expression ({e.msg})") from None
  value = _evaluate(tree)
  if isinstance(value, float):
    return f"{value:.12g}"
  return str(value)


def _evaluate(node: ast.AST) -> int | float:
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    value = node.value
  elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    value = _UNARY[type(node.op)](_evaluate(node.operand))
  elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
      raise ValueError(f"exponents are limited to {_MAX_EXPONENT}")
    if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
      raise ValueError("division by zero")
    value = _BINARY[type(node.op)](left, right)
  else:
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")
  if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
    raise ValueError("the value is out of range (beyond 1e30, or complex)")
  return value


CALCULATOR = Tool("calculator", "Evaluates an arithmetic expression (+ - * / // % ** and parentheses).",
                  {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                  calculate)

_STORIES = (
    ("A warehouse holds {a} crates of {b} bolts each. {c} bolts are shipped out. How many bolts remain?", "-"),
    ("A farm packs {a} boxes with {b} apples in each, then adds {c} loose apples. How many apples are there?", "+"),
    ("A printer prints {a} pages a day for {b} days, minus {c} misprints. How many good pages are printed?", "-"),
    ("{a} workers each earn {b} coins a week; a bonus of {c} coins is shared too. How many coins are paid?", "+"),
)
_ANSWER_RULE = "When you know the result, reply with `Answer: <integer>` and nothing else."


@dataclasses.dataclass(frozen=True)
class CalculatorTasks:
  """Word problems a*b±c with a, b of 3-4 digits and c of 4, task i a pure function of (seed, i, split).

  A record also holds the problem's arithmetic as "expression" (`"a * b - c"`),
  which the environment never reads: `CalculatorEnv.demonstration` calls the
  calculator on it.

  Attributes:
    seed: selects the stream.
    split: "train" or "held_out" (`ptx.data.splits`: by the problem's story and numbers).
  """

  seed: int = 0
  split: str = "train"

  def __post_init__(self):
    splits.check("CalculatorTasks", self.split)

  def __getitem__(self, i: int) -> dict[str, Any]:
    """Task i: `{"prompt", "answer", "expression"}`."""
    rng = np.random.default_rng([self.seed, i, splits.SPLITS.index(self.split)])

    def candidate():
      story = int(rng.integers(len(_STORIES)))
      a, b, c = int(rng.integers(100, 10_000)), int(rng.integers(100, 1_000)), int(rng.integers(1_000, 10_000))
      return f"{story}:{a}:{b}:{c}", (story, a, b, c)

    story, a, b, c = splits.draw("CalculatorTasks", self.split, candidate)
    text, sign = _STORIES[story]
    return {"prompt": text.format(a=a, b=b, c=c), "answer": a * b + (c if sign == "+" else -c),
            "expression": f"{a} * {b} {sign} {c}"}


@dataclasses.dataclass
class CalculatorEpisode:
  """One attempt: tool calls answered until one turn answers."""

  prompt: str
  answer: int
  tools: ToolRegistry

  def step(self, action: str) -> Step:
    """Answers the turn's tool calls (counted in the Step), or scores its answer."""
    results = self.tools.run(action)
    if results:
      return Step(observation="\n".join(text for _, text, _ in results), tool_calls=len(results),
                  tool_errors=sum(not ok for _, _, ok in results))
    answers = _ANSWER.findall(action)
    if not answers:
      return Step(observation="No tool call and no `Answer: <integer>` found: call the calculator or answer.")
    if len(answers) > 1:
      return Step.final(Outcome.WRONG, f"{len(answers)} answers in one turn; exactly one counts")
    text = answers[0].replace(",", "")
    digits = text.lstrip("-").lstrip("0") or "0"
    if len(digits) > len(str(abs(self.answer))):  # wrong without int(), which refuses over 4,300 digits
      return Step.final(Outcome.WRONG, f"an answer of {len(digits)} digits is not {self.answer}")
    got = -int(digits) if text.startswith("-") else int(digits)
    if got == self.answer:
      return Step.final(Outcome.OK, f"{got} is right")
    return Step.final(Outcome.WRONG, f"{got} is not {self.answer}")

  def close(self) -> None:
    """Holds nothing."""


@dataclasses.dataclass(frozen=True)
class CalculatorEnv:
  """Arithmetic word problems with a calculator (see the module docstring).

  Attributes:
    max_turns: turns per episode.
    tool_format: the model family's tool-call format (`ptx.envs.tools.FORMATS`).
    instructions: whether the prompt follows the problem with the tool's
      description, how to call it and how to answer; False poses the problem
      alone, for a model that has learned the tool (SFT on `demonstration`s),
      which then reads about 300 fewer prompt bytes an episode.
  """

  name: str = "calculator"
  max_turns: int = 4
  sandboxed: bool = False
  tool_format: str = "hermes"
  instructions: bool = True

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks a `{"prompt", "answer"}` record's fields."""
    user_turn(task, self.name)
    field(task, "answer", int, self.name)

  def reset(self, task: Mapping[str, Any]) -> CalculatorEpisode:
    """Starts an episode for a `{"prompt", "answer"}` record."""
    self.validate(task)
    prompt, answer = user_turn(task, self.name), task["answer"]
    tools = ToolRegistry([CALCULATOR], self.tool_format)
    if self.instructions:
      prompt = f"{prompt}\n\n{tools.instructions()} {_ANSWER_RULE}"
    return CalculatorEpisode(prompt, answer, tools)

  def demonstration(self, task: Mapping[str, Any]) -> list[dict[str, str]]:
    """A solved episode of `task` as chat messages: the prompt, a calculator call, its result, the answer.

    The episode is played through `reset` and `step`, so the prompt and the
    tool's result are exactly what an episode shows the model, the call is in
    this environment's `tool_format`, and the answer copies the result.

    Args:
      task: a record with "prompt", "answer" and "expression" (the problem's
        arithmetic, as `CalculatorTasks` writes it).

    Returns:
      `ptx.data.chat` messages: user, assistant, tool, assistant.

    Raises:
      ValueError: naming the field, for a record without "expression", or one
        whose expression the calculator refuses or whose value is not its answer.
    """
    expression = field(task, "expression", str, self.name)
    episode = self.reset(task)
    call = render_calls(self.tool_format, [Call(CALCULATOR.name, {"expression": expression})])
    step = episode.step(call)
    if step.tool_errors or step.done:
      raise ValueError(f"{self.name} task field 'expression' ({expression!r}): the calculator answered "
                       f"{step.observation!r}")
    answer = f"Answer: {step.observation}"
    final = episode.step(answer)
    if final.outcome != Outcome.OK:
      raise ValueError(f"{self.name} task field 'expression' ({expression!r}) is not the answer: {final.reason}")
    return [{"role": "user", "content": episode.prompt}, {"role": "assistant", "content": call},
            {"role": "tool", "content": step.observation}, {"role": "assistant", "content": answer}]

