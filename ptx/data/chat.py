"""Chat templates: a conversation rendered as segments that are or are not trained on.

A template turns a list of messages (`{"role": ..., "content": ...}`) into
`(text, is_target)` segments. `encode_chat` encodes each segment on its own
and concatenates, so the loss mask covers exactly the assistant turns (their
content and end-of-turn marker, never the role header or the other turns)
whatever the tokenizer's merges would do across a boundary.

Two templates: the built-in `ChatMLTemplate` (no dependencies; the default
where a tokenizer carries no template) and `JinjaChatTemplate` for the HF
`chat_template` strings of real models. A Jinja template renders whole
conversations only, so the assistant spans are found by rendering prefixes:
turn i spans render(messages[:i+1]) minus render(messages[:i],
add_generation_prompt=True). Templates whose prefixes do not extend each other
(one that rewrites earlier turns) are refused with an error instead of being
masked wrongly.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Callable, Mapping, Protocol, Sequence

from ptx.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
Message = Mapping[str, Any]
Segments = list[tuple[str, bool]]


class ChatTemplate(Protocol):
  """Renders messages as (text, is_target) segments."""

  # Whether encode_chat puts the tokenizer's bos id before the rendering
  # (Jinja templates of HF models write their bos text themselves).
  add_bos: bool

  def segments(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> Segments: ...


@dataclasses.dataclass(frozen=True)
class ChatMLTemplate:
  """`<|im_start|>role\\ncontent<|im_end|>\\n` per turn (Qwen, SmolLM2 style).

  A content that is a list of parts (`{"type": "text", "text": ...}`, `{"type": "image", ...}`) renders its text
  parts as written and each image part as `image_text`, the placeholder the image's tokens replace.
  """

  add_bos: bool = True
  # What an image part renders as: the placeholder of the Idefics3 / SmolVLM processors (ptx.data.image_tokens).
  image_text: str = "<image>"

  def segments(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> Segments:
    """Segments of the conversation; assistant content plus `<|im_end|>` are targets."""
    out: Segments = []
    for m in messages:
      header = f"<|im_start|>{m['role']}\n"
      content = m["content"] if isinstance(m["content"], str) else "".join(
          part["text"] if part["type"] == "text" else self.image_text for part in m["content"])
      if m["role"] == "assistant":
        out += [(header, False), (content + "<|im_end|>", True), ("\n", False)]
      else:
        out.append((header + content + "<|im_end|>\n", False))
    if add_generation_prompt:
      out.append(("<|im_start|>assistant\n", False))
    return _merge(out)


class JinjaChatTemplate:
  """An HF `chat_template` (Jinja2), rendered in a sandbox as transformers does.

  Args:
    source: the template text.
    bos_token: text bound to `bos_token` in the template.
    eos_token: text bound to `eos_token` in the template.
  """

  add_bos = False

  def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # the hf extra

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    # As transformers renders: Jinja's own tojson escapes HTML (`<` as \u003c), ASCII-escapes, sorts keys and
    # returns markup, so a tool call or result rendered through it would differ from what the model was trained on.
    env.filters["tojson"] = _tojson
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    self.source = source
    self._template = env.from_string(source)
    self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

  def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The whole conversation as text, exactly as the model saw it in training."""
    return self._template.render(
        messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **self._tokens)

  def segments(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> Segments:
    """Segments found by rendering prefixes; raises ValueError if they disagree."""
    out: Segments = []
    done = ""
    for i, m in enumerate(messages):
      if m["role"] != "assistant":
        continue
      head = self.render(messages[:i], add_generation_prompt=True)
      full = self.render(messages[: i + 1])
      _check_prefix(done, head, i)
      _check_prefix(head, full, i)
      # Line breaks after the end-of-turn marker are layout, not the reply
      # (HF's {% generation %} blocks leave them out too).
      turn = full[len(head):]
      reply = turn.rstrip("\n")
      out += [(head[len(done):], False), (reply, True), (turn[len(reply):], False)]
      done = full
    rest = self.render(messages, add_generation_prompt)
    _check_prefix(done, rest, len(messages))
    out.append((rest[len(done):], False))
    return _merge(out)


CHATML = ChatMLTemplate()


def validate_messages(messages: Any) -> None:
  """Raises ValueError unless `messages` is a non-empty list of role/content dicts."""
  if not isinstance(messages, list) or not messages:
    raise ValueError(f"'messages' must be a non-empty list, got {type(messages).__name__}")
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
    if m.get("role") not in ROLES:
      raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {m.get('role')!r}")
    if not isinstance(m.get("content"), str):
      raise ValueError(f"messages[{i}].content must be a string, got {type(m.get('content')).__name__}")


def encode_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    template: ChatTemplate | None = None,
    add_generation_prompt: bool = False,
    encode_text: Callable[[str], tuple[list[int], list[int]]] | None = None,
) -> tuple[list[int], list[int]]:
  """Encodes a conversation; the mask is 1 exactly on assistant-turn tokens.

  Args:
    tokenizer: any `Tokenizer`.
    messages: the conversation, already checked by `validate_messages`.
    template: defaults to the tokenizer's `chat_template`, else ChatML.
    add_generation_prompt: end with the header of a new assistant turn (for
      prompts to sample from).
    encode_text: encodes one segment's text into (ids, trainable): 0 where
      a token never enters the loss even in an assistant turn (an image's
      tokens); default `tokenizer.encode`, every token trainable.

  Returns:
    (token ids, loss mask), two lists of equal length.
  """
  template = template or getattr(tokenizer, "chat_template", None) or CHATML
  ids: list[int] = []
  mask: list[int] = []
  if template.add_bos and tokenizer.bos_id is not None:
    ids.append(tokenizer.bos_id)
    mask.append(0)
  for text, target in template.segments(messages, add_generation_prompt):
    piece, trainable = encode_text(text) if encode_text else (tokenizer.encode(text), None)
    ids += piece
    mask += [int(target)] * len(piece) if trainable is None else [int(target) & t for t in trainable]
  return ids, mask


def _merge(segments: Segments) -> Segments:
  """Joins neighbouring segments with the same flag and drops empty ones."""
  out: Segments = []
  for text, target in segments:
    if not text:
      continue
    if out and out[-1][1] == target:
      out[-1] = (out[-1][0] + text, target)
    else:
      out.append((text, target))
  return out


def _check_prefix(prefix: str, text: str, turn: int) -> None:
  if not text.startswith(prefix):
    raise ValueError(
        f"chat template rewrites earlier turns when rendering through message {turn}; "
        "assistant spans cannot be located by prefix, so the loss mask would be wrong")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
  raise ValueError(f"chat template: {message}")
