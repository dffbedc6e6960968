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

Forms (`FORMATS`), each the one its family's chat template teaches, read by
`parse_calls` and written by `render_calls` (`family_format` picks one from
a tokenizer's chat template):
  hermes   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
           block a call, any number (Qwen 2.5 / 3, Hermes)
  smollm2  `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`:
           a JSON list of calls in one block, `[]` for none (SmolLM2)
  llama3   `{"name": ..., "parameters": {...}}` as the whole turn, optionally
           after `<|python_tag|>`, several separated by `;` (Llama 3.1+
           custom tools; Llama writes parallel calls so)
  gemma    a fenced ```tool_code block of `name(arg=value, ...)` lines with
           literal values; the name may be dotted (`math.factorial`)
           (Gemma's function-calling prompts)

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

FORMATS = ("hermes", "smollm2", "llama3", "gemma")
_JSON_LIMITS = "the tool call's JSON nests too deep or holds an integer over 4,300 digits"
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
  if fmt == "smollm2":
    return [call for body in _spans(text, "<tool_call>", "</tool_call>") for call in _json_list(body)]
  if fmt == "llama3":
    body = text.split("<|python_tag|>", 1)[-1].strip()
    return _json_sequence(body) if body.startswith("{") else []
  if fmt == "gemma":
    return [_python_call(line) for block in _spans(text, "```tool_code", "```", own_line=True)
            for line in block.strip().splitlines() if line.strip()]
  raise ValueError(f"tool call format must be one of {FORMATS}, got {fmt!r}")


def render_calls(fmt: str, calls: Sequence[Call]) -> str:
  """A turn making `calls`, written as a model of family `fmt` writes them (what `parse_calls` reads back).

  Args:
    fmt: one of FORMATS.
    calls: the calls (their names and arguments; a gemma call's arguments are literals).

  Returns:
    The text of the turn.
  """
  if fmt == "hermes":  # Qwen's template puts the object on a line of its own
    return "\n".join(f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>"
                     for c in calls)
  if fmt == "smollm2":
    return "<tool_call>[\n" + ",\n".join(json.dumps({"name": c.name, "arguments": c.arguments}) for c in calls) + \
        "\n]</tool_call>"
  if fmt == "llama3":
    return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)
  if fmt == "gemma":
    lines = [f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})" for c in calls]
    return "```tool_code\n" + "\n".join(lines) + "\n```"
  raise ValueError(f"tool call format must be one of {FORMATS}, got {fmt!r}")


def family_format(tokenizer: Any) -> str:
  """The tool-call form (one of FORMATS) the family of `tokenizer`'s chat template teaches.

  Read from the template's own text: SmolLM2's (its tool prompt's `<tool_call>[`, or its system prompt naming
  SmolLM, whose small models' templates teach no tools) before the other ChatML ones (Qwen: hermes), Llama 3's
  header tokens, Gemma's turn tokens. A tokenizer without a Jinja template is rendered in ptx's ChatML: hermes.

  Args:
    tokenizer: the policy's tokenizer (its `chat_template`, if any).

  Returns:
    The form's name.

  Raises:
    ValueError: for a template of no family known here (pass the environment's `tool_format` yourself).
  """
  template = getattr(getattr(tokenizer, "chat_template", None), "source", None)
  if template is None:
    return "hermes"
  if "<tool_call>[" in template or "named SmolLM" in template:
    return "smollm2"
  for marker, fmt in (("<tool_call>", "hermes"), ("<|im_start|>", "hermes"), ("<|start_header_id|>", "llama3"),
                      ("<start_of_turn>", "gemma")):
    if marker in template:
      return fmt
  raise ValueError(f"the chat template is of no family whose tool-call form is known ({FORMATS}); set the "
                   "environment's tool_format")


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
    call = render_calls(self.fmt, [Call(tool.name, {k: "..." for k in tool.parameters.get("properties", {})})])
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
  value, error = _json_value(body)
  return Call(error=error) if error else _call_of(value, arguments_key)


def _json_list(body: str) -> list[Call]:
  """The calls of a smollm2 block: a JSON list of `{"name", "arguments"}` objects (a lone object is one call)."""
  value, error = _json_value(body)
  if error:
    return [Call(error=error)]
  return [_call_of(item, "arguments") for item in (value if isinstance(value, list) else [value])]


def _json_value(body: str) -> tuple[Any, str]:
  """The JSON value of `body` and "", or None and why it is none."""
  try:
    return json.loads(body), ""
  except json.JSONDecodeError as e:
    return None, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"
  except (ValueError, RecursionError):  # JSON past the parser's limits: an integer over 4,300 digits, deep nesting
    return None, _JSON_LIMITS


def _json_sequence(body: str) -> list[Call]:
  """The calls of a llama3 turn: JSON objects with "name" and "parameters", separated by `;`."""
  decoder, out, at = json.JSONDecoder(), [], 0
  while True:
    try:
      value, at = decoder.raw_decode(body, at)
    except json.JSONDecodeError as e:
      return [*out, Call(error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")]
    except (ValueError, RecursionError):
      return [*out, Call(error=_JSON_LIMITS)]
    out.append(_call_of(value, "parameters"))
    rest = body[at:].lstrip()
    if not rest:
      return out
    if not rest.startswith(";"):
      return [*out, Call(error=f"text after a tool call at character {len(body) - len(rest)}: calls are JSON "
                               "objects separated by ';' and nothing else")]
    rest = rest[1:].lstrip()
    if not rest:  # a last call closed by `;` too
      return out
    at = len(body) - len(rest)


def _call_of(value: Any, arguments_key: str) -> Call:
  """The call a decoded JSON value names, or why it names none."""
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
  if not isinstance(node, ast.Call):
    return Call(error="a tool call must be name(argument=value, ...)")
  parts, callee = [], node.func
  while isinstance(callee, ast.Attribute):  # a dotted name, walked without recursion (it may be very long)
    parts.append(callee.attr)
    callee = callee.value
  if not isinstance(callee, ast.Name):
    return Call(error=f"a tool call's function must be a name or a dotted name (like math.factorial), not a "
                      f"{type(callee).__name__} expression")
  if node.args or any(k.arg is None for k in node.keywords):
    return Call(error="a tool call must be name(argument=value, ...) with keyword arguments only")
  try:
    arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
  except (ValueError, TypeError, RecursionError):  # TypeError: a set or dict key that is a list (`{[1]}`)
    return Call(error="tool call arguments must be literal values")
  return Call(name=".".join([callee.id, *reversed(parts)]), arguments=arguments)
