"""Chat templates: loss masks cover exactly the assistant turns."""

import pytest

from ptx.data.chat import CHATML, JinjaChatTemplate, encode_chat, validate_messages
from ptx.data.tokenizer import ByteTokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+5?"},
    {"role": "assistant", "content": "8, since 3+5=8."},
]

# The ChatML template as HF models ship it.
CHATML_JINJA = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _spans(mask):
  """(start, end) of each run of ones."""
  spans, start = [], None
  for i, m in enumerate(list(mask) + [0]):
    if m and start is None:
      start = i
    elif not m and start is not None:
      spans.append((start, i))
      start = None
  return spans


@pytest.mark.parametrize("template", [CHATML, JinjaChatTemplate(CHATML_JINJA)], ids=["builtin", "jinja"])
def test_multi_turn_mask_covers_exactly_the_assistant_turns(template):
  tok = ByteTokenizer()
  ids, mask = encode_chat(tok, CHAT, template)
  assert len(ids) == len(mask)
  targets = [tok.decode(ids[a:b]) for a, b in _spans(mask)]
  assert targets == ["4<|im_end|>", "8, since 3+5=8.<|im_end|>"]
  # Everything else is the rendering of the other turns and the headers.
  text = tok.decode(ids)
  assert text.count("<|im_start|>assistant\n") == 2
  assert sum(mask) == len(tok.encode("4<|im_end|>8, since 3+5=8.<|im_end|>"))


def test_builtin_and_jinja_chatml_render_the_same_tokens():
  tok = ByteTokenizer()
  ids, mask = encode_chat(tok, CHAT, CHATML)
  jids, jmask = encode_chat(tok, CHAT, JinjaChatTemplate(CHATML_JINJA))
  assert ids[0] == tok.bos_id and (ids[1:], mask[1:]) == (jids, jmask)


def test_generation_prompt_ends_with_an_assistant_header():
  tok = ByteTokenizer()
  ids, mask = encode_chat(tok, CHAT[:2], CHATML, add_generation_prompt=True)
  assert tok.decode(ids).endswith("<|im_start|>assistant\n") and not any(mask)


def test_template_that_rewrites_earlier_turns_is_refused():
  # Renders only the last message: prefixes do not extend each other.
  tok = ByteTokenizer()
  template = JinjaChatTemplate("{{ messages[-1]['content'] if messages else '' }}")
  with pytest.raises(ValueError, match="rewrites earlier turns"):
    encode_chat(tok, CHAT, template)


def test_template_raise_exception_surfaces_as_value_error():
  template = JinjaChatTemplate("{{ raise_exception('roles must alternate') }}")
  with pytest.raises(ValueError, match="roles must alternate"):
    template.render(CHAT)


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"role": "bot", "content": "x"}], "role"),
    ([{"role": "user", "content": 3}], "content"),
    (["hi"], "object"),
])
def test_validate_messages_rejects_malformed_conversations(messages, match):
  with pytest.raises(ValueError, match=match):
    validate_messages(messages)


def test_tojson_renders_as_transformers_does_not_as_jinjas_html_filter():
  # Jinja's own filter would give "a\u003cb \u00e9 \u0027x\u0027", sorted keys, and markup that escapes what is
  # added to it; the models' templates were rendered with json.dumps in training.
  template = JinjaChatTemplate("{% for m in messages %}{{ '<|x|>' + m | tojson }}{{ m.content | tojson(indent=2) }}"
                               "{% endfor %}")
  message = {"role": "tool", "content": "a<b é 'x'"}
  assert template.render([message]) == '<|x|>{"role": "tool", "content": "a<b é \'x\'"}"a<b é \'x\'"'
