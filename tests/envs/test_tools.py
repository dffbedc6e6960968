"""Tool calls: the families' formats parse, and every bad call is answered with an error that names what is wrong."""

import random
import re
import time

import pytest

from ptx.sandbox import run as sandbox
from ptx.sandbox.result import Outcome, SandboxResult, Usage
from ptx.envs.tools import FORMATS, Call, Tool, ToolRegistry, ToolUnavailable, _json_call, _python_call, parse_calls

ADD = Tool("add", "Adds two integers.", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                          "b": {"type": "integer"}},
                                         "required": ["a", "b"]}, lambda a, b: str(a + b))
ECHO = Tool("echo", "Echoes text.", {"type": "object", "properties": {"text": {"type": "string"},
                                                                      "loud": {"type": "boolean"}},
                                     "required": ["text"]}, lambda text, loud=False: text.upper() if loud else text)
BROKEN = Tool("broken", "Always fails.", {"type": "object", "properties": {}}, lambda: 1 / 0)


def test_each_family_format_parses_its_calls():
  hermes = ('thinking <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
            '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>')
  assert parse_calls(hermes, "hermes") == [Call("add", {"a": 1, "b": 2}), Call("echo", {"text": "hi"})]
  assert parse_calls('<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}', "llama3") == [
      Call("add", {"a": 3, "b": 4})]
  assert parse_calls('{"name": "echo", "parameters": {"text": "x"}}', "llama3") == [Call("echo", {"text": "x"})]
  gemma = "Let me call.\n```tool_code\nadd(a=5, b=6)\necho(text='yo', loud=True)\n```"
  assert parse_calls(gemma, "gemma") == [Call("add", {"a": 5, "b": 6}), Call("echo", {"text": "yo", "loud": True})]
  for fmt in ("hermes", "llama3", "gemma"):
    assert parse_calls("The answer is 7.", fmt) == []
  with pytest.raises(ValueError, match="format must be one of"):
    parse_calls("x", "chatml")


def test_unreadable_calls_carry_the_reason():
  (bad_json,) = parse_calls('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "hermes")
  assert "not valid JSON" in bad_json.error and "character" in bad_json.error
  (nameless,) = parse_calls('<tool_call>{"arguments": {}}</tool_call>', "hermes")
  assert 'with a "name"' in nameless.error
  positional, computed, broken = parse_calls("```tool_code\nadd(1, 2)\nadd(a=__import__('os'), b=1)\nadd(a=\n```",
                                             "gemma")
  assert "keyword arguments only" in positional.error
  assert "literal values" in computed.error
  assert "not a Python call" in broken.error


def test_the_registry_answers_every_call_and_names_each_error():
  tools = ToolRegistry([ADD, ECHO, BROKEN], max_calls=6)
  calls = "".join(f"<tool_call>{body}</tool_call>" for body in (
      '{"name": "add", "arguments": {"a": 2, "b": 40}}',
      '{"name": "mul", "arguments": {}}',
      '{"name": "add", "arguments": {"a": 2}}',
      '{"name": "add", "arguments": {"a": true, "b": 1}}',
      '{"name": "echo", "arguments": {"text": "hi", "volume": 3}}',
      '{"name": "broken", "arguments": {}}',
      '{"name": "echo", "arguments": {"text": "late"}}'))
  answers = [(text, ok) for _, text, ok in tools.run(calls)]
  assert answers[0] == ("42", True)
  assert answers[1] == ("error: no tool named 'mul'; the tools are ['add', 'broken', 'echo']", False)
  assert answers[2] == ("error: add needs argument 'b'", False)
  assert answers[3] == ("error: argument 'a' of add must be integer, got bool", False)  # JSON true is no integer
  assert answers[4] == ("error: echo has no argument 'volume'; it takes ['loud', 'text']", False)
  assert answers[5] == ("error: broken failed: ZeroDivisionError: division by zero", False)
  assert answers[6] == ("error: at most 6 tool calls are answered per turn", False)
  assert tools.run('<tool_call>{"name": "echo", "arguments": "hi"}</tool_call>')[0][1] == (
      "error: the arguments of echo must be an object, got str")
  assert [s["function"]["name"] for s in tools.schemas()] == ["add", "echo", "broken"]
  with pytest.raises(ValueError, match="unique"):
    ToolRegistry([ADD, ADD])
  with pytest.raises(ValueError, match="format must be one of"):
    ToolRegistry([ADD], "xml")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_prompt_instructions_show_a_call_the_registry_parses(fmt):
  tools = ToolRegistry([ECHO], fmt)
  text = tools.instructions()
  assert "echo(text, loud): Echoes text." in text
  example = text.split("To call one, reply with ", 1)[1].rstrip(".")
  assert parse_calls(example, fmt) == [Call("echo", {"text": "...", "loud": "..."})]


def test_an_episodes_call_and_time_budgets_refuse_calls_by_name():
  tools = ToolRegistry([ADD, ECHO], max_episode_calls=3)
  call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
  bad = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
  assert [ok for _, _, ok in tools.run(call + bad)] == [True, False]  # a failed call is answered, and counts
  assert [text for _, text, _ in tools.run(call + call)] == ["3", "error: this episode's 3 tool calls are used up"]
  assert tools.run(call)[0][1] == "error: this episode's 3 tool calls are used up" and tools.calls_used == 3
  clock = []
  slow = Tool("slow", "Takes a while.", {"type": "object", "properties": {}},
              lambda: clock.append(time.sleep(0.05)) or "done")
  timed = ToolRegistry([slow], max_episode_seconds=0.04)
  # The first call may start (no time is spent yet); it overruns the budget, so the next is refused.
  assert [text for _, text, _ in timed.run('<tool_call>{"name": "slow"}</tool_call>' * 2)] == [
      "done", "error: this episode's 0.04 s of tool time are used up"]
  assert len(clock) == 1
  with pytest.raises(ValueError, match="max_episode_calls must be > 0"):
    ToolRegistry([ADD], max_episode_calls=0)


def test_a_command_tool_runs_sandboxed_with_its_arguments_on_stdin_and_names_its_failures():
  script = ("import json, sys; a = json.load(sys.stdin); n = a['n']\n"
            "if n < 0: sys.exit('negative ' + str(n))\n"
            "print(n * n)")
  square = Tool.command("square", "Squares n.", {"type": "object", "properties": {"n": {"type": "integer"}},
                                                   "required": ["n"]}, ["python3", "-c", script])
  tools = ToolRegistry([square])
  answers = [(text.strip(), ok) for _, text, ok in tools.run(
      '<tool_call>{"name": "square", "arguments": {"n": 12}}</tool_call>'
      '<tool_call>{"name": "square", "arguments": {"n": -3}}</tool_call>'
      '<tool_call>{"name": "square", "arguments": {"n": "12; rm -rf /"}}</tool_call>')]
  assert answers[0] == ("144", True)
  assert answers[1][0].startswith("error: square failed: RuntimeError: exit 1") and "negative -3" in answers[1][0]
  assert answers[2] == ("error: argument 'n' of square must be integer, got str", False)


def test_a_tool_that_cannot_run_fails_the_step_instead_of_answering_the_model(monkeypatch):
  tool = Tool.command("t", "x", {"type": "object", "properties": {}}, ["true"])
  infra = SandboxResult(Outcome.INFRA_ERROR, None, b"", b"", False, Usage(0.0, 0.0, 0.0, 0), False, None,
                        "no sandbox could start")
  monkeypatch.setattr(sandbox, "run", lambda *a, **k: infra)
  with pytest.raises(ToolUnavailable, match="tool t: no sandbox"):
    ToolRegistry([tool]).run('<tool_call>{"name": "t"}</tool_call>')


# Calls a policy can write that the standard library's parsers refuse with something other than a syntax error: an
# integer past Python's 4,300-digit conversion limit, nesting past the recursion limit, a parser stack overflow, an
# AST too deep to build, literals that do not evaluate, text that is not UTF-8.
DIGITS = "1" * 5000
PATHOLOGICAL = {
    "hermes-int-of-5000-digits": ("hermes", '<tool_call>{"name": "add", "arguments": {"a": %s}}</tool_call>' % DIGITS),
    "hermes-nested-1000-deep": ("hermes", "<tool_call>" + "[" * 1000 + "]" * 1000 + "</tool_call>"),
    "hermes-nested-100000-deep": ("hermes", "<tool_call>" + '{"a": ' * 100_000 + "</tool_call>"),
    "llama3-int-of-5000-digits": ("llama3", '{"name": "add", "parameters": {"a": %s, "b": 1}}' % DIGITS),
    "llama3-nested-1000-deep": ("llama3", '{"name": "add", "parameters": ' + "[" * 1000 + "]" * 1000 + "}"),
    "gemma-set-of-a-list": ("gemma", "```tool_code\nadd(a={[1]}, b=1)\n```"),
    "gemma-dict-keyed-by-a-list": ("gemma", "```tool_code\nadd(a={[1]: 2}, b=1)\n```"),
    "gemma-int-of-5000-digits": ("gemma", f"```tool_code\nadd(a={DIGITS}, b=1)\n```"),
    "gemma-100000-minus-signs": ("gemma", "```tool_code\nadd(a=" + "-" * 100_000 + "1, b=1)\n```"),
    "gemma-100000-additions": ("gemma", "```tool_code\nadd(a=1" + "+1" * 100_000 + ", b=1)\n```"),
    "gemma-100000-attributes": ("gemma", "```tool_code\nadd" + ".x" * 100_000 + "(a=1, b=1)\n```"),
    "gemma-lone-surrogate": ("gemma", "```tool_code\nadd(a='\ud800', b=1)\n```"),
}


@pytest.mark.parametrize("fmt, text", PATHOLOGICAL.values(), ids=PATHOLOGICAL)
def test_a_call_the_parsers_cannot_read_is_the_models_malformed_call_never_an_exception(fmt, text):
  ((call, answer, ok),) = ToolRegistry([ADD], fmt).run(text)
  assert call.error and answer == f"error: {call.error}" and not ok


class Counted(str):
  """A text that counts the characters its searches read (`find`, `split`): the parser's work, with no clock."""

  def __new__(cls, text):
    self = super().__new__(cls, text)
    self.read = 0
    return self

  def find(self, sub, start=0, end=None):
    at = super().find(sub, start, end)
    self.read += (at + len(sub) if at >= 0 else len(self)) - start
    return at

  def split(self, sep=None, maxsplit=-1):
    self.read += len(self)
    return super().split(sep, maxsplit)


@pytest.mark.parametrize("fmt, unit", [
    ("hermes", "<tool_call>"), ("hermes", "<tool_call>{}</tool_call>"), ("hermes", "</tool_call><tool_call>x"),
    ("llama3", "<|python_tag|>"), ("llama3", '{"a": '),
    ("gemma", "```tool_code\n"), ("gemma", "```tool_code x"), ("gemma", "\n")])
def test_finding_the_calls_reads_the_text_once_whatever_the_model_writes(fmt, unit):
  # 8,000 unclosed <tool_call> tags took seconds with a lazy regex, which tries each opening against the rest of the
  # text; a fence opening followed by 8,000 line breaks, likewise. Each character is read once, none more than twice.
  text = Counted(("```tool_code" if unit == "\n" else "") + unit * 8000)
  calls = ToolRegistry([ADD], fmt).run(text)
  assert len(text) <= text.read <= 2 * len(text)
  assert all(not ok for _, _, ok in calls)


def test_the_one_pass_search_finds_what_the_formats_regexes_find():
  # The patterns the formats were first read with (each quadratic on unclosed openings), as the reference.
  hermes = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
  gemma = re.compile(r"```tool_code\s*\n(.*?)```", re.DOTALL)
  pieces = ["<tool_call>", "</tool_call>", "```tool_code", "```", "`", "\n", "\r\n", " ", "\u2003", "x", "f(a=1)"]
  rng = random.Random(0)
  for _ in range(20_000):
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
    assert parse_calls(text, "hermes") == [_json_call(body, "arguments") for body in hermes.findall(text)], text
    assert parse_calls(text, "gemma") == [_python_call(line) for block in gemma.findall(text)
                                          for line in block.strip().splitlines() if line.strip()], text
