"""Tools a model calls in an episode: a registry of named, schema-checked functions, and the families' call formats.

A `Tool` is a name, a description, a JSON schema of its arguments (an object
of named properties of type string, number, integer, boolean, array or
object, some `required`) and a function that returns the result as text: a
Python function, or a program run in the OS sandbox (`Tool.command`: the
arguments as a JSON object on its standard input, its standard output the
result, a fresh workspace each call). `ToolRegistry.run(text)` finds the
calls in a model's turn in one family's format and answers each: the result,
or an error that says what was wrong with that call (unparsable, an unknown
tool, a missing or mistyped argument, the tool raising or its program
failing, the episode's call or time budget spent), so the model sees it as
an observation and can recover; nothing a model writes makes the environment
fail. Only a tool that cannot run at all (`ToolUnavailable`: the sandbox
could not start) fails the step, which the episode loop scores as an
infrastructure error, never as the model's.

A registry serves one episode: its budgets (`max_episode_calls`,
`max_episode_seconds`) count that episode's calls. Time is checked between
calls (a Python function cannot be interrupted; a command's own sandbox
timeout bounds each of its runs).

Formats (`FORMATS`):
  hermes  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
          number (Qwen 2.5 / 3, SmolLM2, Hermes)
  llama3  one JSON object `{"name": ..., "parameters": {...}}` as the whole
          turn, optionally after `<|python_tag|>` (Llama 3.1+ custom tools)
  gemma   a fenced ```tool_code block holding `name(arg=value, ...)` with
          literal values (Gemma's function-calling prompts)

Calls are found in one pass over the turn, and a call past a parser's
limits (an integer over 4,300 digits, nesting too deep) is an unparsable
call like any other.

Tools should be idempotent: a turn that is retried, or a call the model
repeats, must give the same answer.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ptx.sandbox import run as sandbox

FORMATS = ("hermes", "llama3", "gemma")
_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "array": list, "object": dict}


@dataclasses.dataclass(frozen=True)
class Tool:
  """A function the model may call.

  Attributes:
    name: what the model calls it by.
    description: what it does, for the prompt.
    parameters: JSON schema of its arguments (an object with `properties`
      and `required`).
    fn: called with the arguments as keywords; returns the result as text.
  """

  name: str
  description: str
  parameters: Mapping[str, Any]
  fn: Callable[..., str]

  @classmethod
  def command(cls, name: str, description: str, parameters: Mapping[str, Any], argv: Sequence[str], *,
              limits: sandbox.Limits = sandbox.Limits(timeout_s=5.0, cpu_s=5)) -> Tool:
    """A tool that runs `argv` in the OS sandbox, once per call, in a fresh workspace (so it is idempotent).

    Args:
      name: what the model calls it by.
      description: what it does, for the prompt.
      parameters: JSON schema of its arguments, which the program reads as
        one JSON object on its standard input.
      argv: the program and its arguments, on the sandbox PATH.
      limits: each run's sandbox limits.

    Returns:
      The tool: its result is the program's standard output; a nonzero exit,
      a timeout or a limit is an error naming it, with the end of stderr.
    """
    return cls(name, description, parameters, _SandboxedCommand(name, tuple(argv), limits))

  def schema(self) -> dict[str, Any]:
    """The tool as chat templates take it (`{"type": "function", "function": {...}}`)."""
    return {"type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}}

  def check(self, arguments: Any) -> str | None:
    """What is wrong with `arguments` for this tool, or None."""
    if not isinstance(arguments, dict):
      return f"the arguments of {self.name} must be an object, got {type(arguments).__name__}"
    properties = self.parameters.get("properties", {})
    missing = [k for k in self.parameters.get("required", ()) if k not in arguments]
    if missing:
      return f"{self.name} needs argument {missing[0]!r}"
    for key, value in arguments.items():
      if key not in properties:
        return f"{self.name} has no argument {key!r}; it takes {sorted(properties)}"
      expected = properties[key].get("type")
      kind = _TYPES.get(expected)
      # JSON booleans are not numbers, though Python's bool is an int.
      if kind is not None and (isinstance(value, bool) != (expected == "boolean") or not isinstance(value, kind)):
        return f"argument {key!r} of {self.name} must be {expected}, got {type(value).__name__}"
    return None


class ToolUnavailable(RuntimeError):
  """A tool could not run at all (the environment's failure, not the model's): the step fails."""


@dataclasses.dataclass(frozen=True)
class _SandboxedCommand:
  """The function of `Tool.command`: one sandboxed run per call."""

  name: str
  argv: tuple[str, ...]
  limits: sandbox.Limits

  def __call__(self, **arguments: Any) -> str:
    result = sandbox.run(list(self.argv), stdin=json.dumps(arguments), limits=self.limits)
    if result.outcome == sandbox.Outcome.OK:
      return result.stdout_text
    if result.outcome == sandbox.Outcome.INFRA_ERROR:
      raise ToolUnavailable(f"tool {self.name}: {result.reason}")
    raise RuntimeError(f"{result.reason}: {result.stderr_text[-500:].strip()}")


@dataclasses.dataclass(frozen=True)
class Call:
  """One tool call found in a turn: the tool's name and arguments, or why it could not be read."""

  name: str = ""
  arguments: Any = None
  error: str = ""  # set when the call could not be parsed


def parse_calls(text: str, fmt: str) -> list[Call]:
  """The tool calls in a model's turn, in order; unreadable ones carry an error.

  Args:
    text: the model's turn, decoded.
    fmt: one of FORMATS.

  Returns:
    The calls; [] when the turn calls no tool.
  """
  if fmt == "hermes":
    return [_json_call(body, "arguments") for body in _spans(text, "<tool_call>", "</tool_call>")]
  if fmt == "llama3":
    body = text.split("<|python_tag|>", 1)[-1].strip()
    return [_json_call(body, "parameters")] if body.startswith("{") else []
  if fmt == "gemma":
    return [_python_call(line) for block in _spans(text, "```tool_code", "```", own_line=True)
            for line in block.strip().splitlines() if line.strip()]
  raise ValueError(f"tool call format must be one of {FORMATS}, got {fmt!r}")


class ToolRegistry:
  """Named tools and the call format a model uses for them.

  Args:
    tools: the tools (names unique).
    fmt: the model family's call format, one of FORMATS.
    max_calls: calls answered per turn; the rest get an error.
    max_episode_calls: calls answered in the episode (every answered call
      counts, failed ones too); None: no limit.
    max_episode_seconds: tool time the episode may spend; once spent,
      further calls get an error. None: no limit.
  """

  def __init__(self, tools: Sequence[Tool], fmt: str = "hermes", *, max_calls: int = 4,
               max_episode_calls: int | None = None, max_episode_seconds: float | None = None):
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
      raise ValueError(f"tool names must be unique, got {names}")
    if fmt not in FORMATS:
      raise ValueError(f"tool call format must be one of {FORMATS}, got {fmt!r}")
    for field, value in (("max_calls", max_calls), ("max_episode_calls", max_episode_calls),
                         ("max_episode_seconds", max_episode_seconds)):
      if value is not None and not value > 0:
        raise ValueError(f"ToolRegistry {field} must be > 0, got {value!r}")
    self.tools, self.fmt, self.max_calls = {t.name: t for t in tools}, fmt, max_calls
    self.max_episode_calls, self.max_episode_seconds = max_episode_calls, max_episode_seconds
    self.calls_used, self.seconds_used = 0, 0.0

  def schemas(self) -> list[dict[str, Any]]:
    """Every tool's schema, for the chat template's `tools`."""
    return [t.schema() for t in self.tools.values()]

  def instructions(self) -> str:
    """For the prompt: each tool and its arguments, and how to call one in this registry's format."""
    lines = [f"- {t.name}({', '.join(t.parameters.get('properties', {}))}): {t.description}"
             for t in self.tools.values()]
    tool = next(iter(self.tools.values()))
    example = {k: "..." for k in tool.parameters.get("properties", {})}
    if self.fmt == "hermes":
      call = f'<tool_call>{json.dumps({"name": tool.name, "arguments": example})}</tool_call>'
    elif self.fmt == "llama3":
      call = json.dumps({"name": tool.name, "parameters": example})
    else:
      call = f"```tool_code\n{tool.name}({', '.join(f'{k}={v!r}' for k, v in example.items())})\n```"
    return "Tools:\n" + "\n".join(lines) + f"\nTo call one, reply with {call}."

  def run(self, text: str) -> list[tuple[Call, str, bool]]:
    """Answers every call in `text`: (the call, the result or an error message, whether it succeeded).

    Raises:
      ToolUnavailable: a tool could not run at all.
    """
    out = []
    for i, call in enumerate(parse_calls(text, self.fmt)):
      refusal = self._refusal(over_turn=i >= self.max_calls)
      if refusal:
        out.append((call, f"error: {refusal}", False))
        continue
      start = time.perf_counter()
      out.append((call, *self._answer(call)))
      self.calls_used += 1
      self.seconds_used += time.perf_counter() - start
    return out

  def _refusal(self, *, over_turn: bool) -> str:
    """Why the next call is not answered ("" when it is)."""
    if over_turn:
      return f"at most {self.max_calls} tool calls are answered per turn"
    if self.max_episode_calls is not None and self.calls_used >= self.max_episode_calls:
      return f"this episode's {self.max_episode_calls} tool calls are used up"
    if self.max_episode_seconds is not None and self.seconds_used >= self.max_episode_seconds:
      return f"this episode's {self.max_episode_seconds:g} s of tool time are used up"
    return ""

  def _answer(self, call: Call) -> tuple[str, bool]:
    if call.error:
      return f"error: {call.error}", False
    tool = self.tools.get(call.name)
    if tool is None:
      return f"error: no tool named {call.name!r}; the tools are {sorted(self.tools)}", False
    problem = tool.check(call.arguments)
    if problem:
      return f"error: {problem}", False
    try:
      return str(tool.fn(**call.arguments)), True
    except ToolUnavailable:
      raise
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation, never the episode's end
      return f"error: {call.name} failed: {type(e).__name__}: {e}", False


def _spans(text: str, opening: str, closing: str, *, own_line: bool = False) -> list[str]:
  """The texts between each `opening` and the first `closing` after it, in order, found in one pass over `text`.

  A lazy regex (`opening(.*?)closing`) would try every unclosed opening against the rest of the text: quadratic.
  With `own_line`, an opening counts only where a line break follows it before any other text (a fence's first line).
  """
  out, at = [], 0
  while (start := text.find(opening, at)) >= 0:
    end = text.find(closing, start + len(opening))
    if end < 0:  # no closing after this opening, so none after a later one either
      break
    body = text[start + len(opening):end]
    if own_line and "\n" not in body[:len(body) - len(body.lstrip())]:
      at = end  # not an opening; the next may begin at this closing
      continue
    out.append(body)
    at = end + len(closing)
  return out


def _json_call(body: str, arguments_key: str) -> Call:
  """A call written as a JSON object with "name" and `arguments_key`."""
  try:
    value = json.loads(body)
  except json.JSONDecodeError as e:
    return Call(error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
  except (ValueError, RecursionError):  # JSON past the parser's limits: an integer over 4,300 digits, deep nesting
    return Call(error="the tool call's JSON nests too deep or holds an integer over 4,300 digits")
  if not isinstance(value, dict) or not isinstance(value.get("name"), str):
    return Call(error='a tool call must be a JSON object with a "name"')
  return Call(name=value["name"], arguments=value.get(arguments_key, {}))


def _python_call(line: str) -> Call:
  """A call written as `name(arg=literal, ...)`."""
  try:
    node = ast.parse(line.strip(), mode="eval").body
  except SyntaxError as e:
    return Call(error=f"the tool call is not a Python call ({e.msg})")
  # Nesting past the parser's limits (MemoryError: its own stack overflowed), or a lone surrogate (ValueError).
  except (ValueError, RecursionError, MemoryError):
    return Call(error="the tool call is not a Python call (it nests too deep or is not valid text)")
  if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
    return Call(error="a tool call must be name(argument=value, ...) with keyword arguments only")
  try:
    arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
  except (ValueError, TypeError, RecursionError):  # TypeError: a set or dict key that is a list (`{[1]}`)
    return Call(error="tool call arguments must be literal values")
  return Call(name=node.func.id, arguments=arguments)
