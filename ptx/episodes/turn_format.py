"""How a multi-turn episode looks in tokens: the first prompt, the ids that end a turn, the environment's replies.

An episode's trajectory is built token by token, never re-tokenised: the
model's tokens are the ones it sampled, and every environment reply is
encoded once, on its own, from the chat template's rendering of the
conversation at that point. `TurnFormat.reply` takes the text the template
puts between the end of the model's turn and the start of its next one (the
end-of-turn marker when the model did not sample it, the reply message under
its role header, the next assistant header) and encodes just that, so the
reply's tokens follow the model's tokens exactly as sampled.

A turn ends at the template's end-of-turn marker when the tokenizer spells it
as one token (`<|im_end|>` of SmolLM2 and Qwen, `<|eot_id|>` of Llama 3,
`<end_of_turn>` of Gemma); otherwise (a byte tokenizer, where the marker is
many tokens) at the tokenizer's eos, and the reply then begins with the marker
as environment tokens. Either way the whole trajectory is what the template
renders for the conversation wherever the tokenizer encodes the rendering's
pieces as it encodes the whole (`render_check` says where it does not).

Families (tests/episodes/test_turn_format_families.py renders each):
  Qwen 2.5 / 3, SmolLM2  ChatML. SmolLM2 has a plain `tool` role; Qwen puts
      a tool message in a user turn as a `<tool_response>` block, consecutive
      ones in one turn. A reply is one tool message, so a turn's
      several results come as one observation, in one block. Qwen 3 keeps the
      `<think>` block of a turn after the user's query when it holds
      reasoning; an empty one (or none) it writes only while the turn is the
      last: a reply still follows such a turn as sampled, but the template
      rewrites the turn once others follow, so the trajectory is not the
      rendering of its conversation (`render_check` raises ValueError).
      Results as user turns would be new queries, dropping all reasoning.
  Llama 3.1+  results under `<|start_header_id|>ipython<|end_header_id|>`,
      JSON-quoted; `<|eot_id|>` ends every turn (`<|eom_id|>`, which the
      model writes after a built-in tool call, is not a stop id). The
      template trims each turn, so a turn that ends in whitespace departs
      there; a tokenizer whose decode drops special tokens drops a sampled
      `<|python_tag|>` from the turn's text, which departs there too.
  Gemma 2 / 3  no tool role: `TurnFormat(reply_role="user")` (what
      `TurnFormat.of` picks for a template that refuses a tool message), the result in a
      ```tool_output fence (the environment's text). Trims like Llama.
A BPE tokenizer that encodes the whole rendering at once, as HF's
`apply_chat_template` does, merges the assistant header's line break with
whitespace that starts the turn (SmolLM2: two spaces, or a space before a
digit); the model, sampling after the header, cannot produce that
(`render_check(..., one_text=True)` finds it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from ptx.data.chat import CHATML, ChatTemplate, Message, encode_chat
from ptx.data.tokenizer import Tokenizer

_PROBE = "\x00probe\x00"  # assistant content no real turn contains


@dataclasses.dataclass(frozen=True)
class TurnFormat:
  """The token form of episodes for one tokenizer and chat template.

  Attributes:
    tokenizer: encodes prompts and replies, decodes the model's turns.
    template: the chat template (default: the tokenizer's, else ChatML).
    reply_role: the role the environment's replies take ("tool": the
      template renders tool results in its family's own way).
  """

  tokenizer: Tokenizer
  template: ChatTemplate | None = None
  reply_role: str = "tool"

  @classmethod
  def of(cls, tokenizer: Tokenizer, template: ChatTemplate | None = None) -> TurnFormat:
    """The format whose replies take the role the template renders: "tool", or "user" where it has none (Gemma)."""
    fmt = cls(tokenizer, template)
    render = getattr(fmt.chat_template, "render", None)  # a Jinja template; the built-in ChatML takes every role
    if render is None:
      return fmt
    try:  # the whole conversation, not its segments: a template may rewrite earlier turns for other reasons (Qwen 3)
      render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
              {"role": "tool", "content": "z"}], add_generation_prompt=True)
    except ValueError:  # a template without a tool role raises on it (Gemma: roles must alternate)
      return cls(tokenizer, template, reply_role="user")
    return fmt

  @property
  def chat_template(self) -> ChatTemplate:
    """The template in use."""
    return self.template or getattr(self.tokenizer, "chat_template", None) or CHATML

  @functools.cached_property
  def end_of_turn(self) -> str:
    """The text the template closes an assistant turn with (`<|im_end|>` for ChatML)."""
    segments = self.chat_template.segments([{"role": "user", "content": "x"},
                                            {"role": "assistant", "content": _PROBE}])
    target = [text for text, is_target in segments if is_target and _PROBE in text]
    if len(target) != 1:
      raise ValueError("chat template: cannot find the assistant turn's span to learn its end-of-turn marker")
    return target[0][target[0].index(_PROBE) + len(_PROBE):]

  @functools.cached_property
  def stop_ids(self) -> tuple[int, ...]:
    """The ids that end the model's turn: the end-of-turn marker when it is one token, else eos."""
    marker = self.tokenizer.encode(self.end_of_turn)
    return (marker[0],) if len(marker) == 1 else (self.tokenizer.eos_id,)

  def prompt(self, text: str) -> list[int]:
    """The first prompt: `text` as a user turn and the assistant header after it."""
    return encode_chat(self.tokenizer, [{"role": "user", "content": text}], self.chat_template,
                       add_generation_prompt=True)[0]

  def action(self, tokens: Sequence[int]) -> str:
    """The text of a model turn for the environment: its tokens, the stop id left out."""
    stops = set(self.stop_ids)
    return self.tokenizer.decode([t for t in tokens if t not in stops])

  def reply(self, messages: Sequence[Message], observation: str, *, closed: bool) -> list[int]:
    """The tokens that follow the model's last turn: the environment's `observation` and the next assistant header.

    Args:
      messages: the conversation so far, ending with the model's turn (its
        decoded text), as `ptx.data.chat` messages.
      observation: the environment's reply.
      closed: whether the model's turn ended with the end-of-turn marker
        itself (a stop id that is the marker); else the marker is written here.

    Returns:
      The token ids to append, encoded from the template's text between the
      model's turn and the next.
    """
    if not messages or messages[-1]["role"] != "assistant":
      raise ValueError("TurnFormat.reply: the conversation must end with the model's turn")
    # The whole rendering, not its segments: a template may rewrite earlier turns (Qwen 3 drops an empty <think>
    # block once a turn is not the last), which changes nothing after the model's turn. The turn is a probe, to be
    # found whatever the template makes of its text.
    probe = _PROBE
    while probe in observation:
      probe += "\x00"
    conversation = [*messages[:-1], {"role": "assistant", "content": probe},
                    {"role": self.reply_role, "content": observation}]
    render = getattr(self.chat_template, "render", None)  # a Jinja template; the built-in ChatML rewrites nothing
    text = (render(conversation, add_generation_prompt=True) if render is not None else
            "".join(piece for piece, _ in self.chat_template.segments(conversation, add_generation_prompt=True)))
    tail = text[text.rindex(probe) + len(probe):]
    if not tail.startswith(self.end_of_turn):
      raise ValueError(f"chat template: a turn followed by a reply does not end with {self.end_of_turn!r}")
    if closed and len(self.tokenizer.encode(self.end_of_turn)) == 1:  # the model sampled the marker itself
      tail = tail[len(self.end_of_turn):]
    return self.tokenizer.encode(tail)

  def render_check(self, messages: Sequence[Message], tokens: Sequence[int], *, one_text: bool = False) -> int | None:
    """Where a trajectory departs from the template's encoding of its whole conversation: None if nowhere.

    Args:
      messages: the conversation (first prompt, the model's turns, the replies).
      tokens: the trajectory's tokens (prompt included).
      one_text: compare with the tokenizer's encoding of the whole rendering
        as one text (as HF's `apply_chat_template` tokenizes it), not of its
        segments one by one (as `encode_chat` does for training).

    Returns:
      The first position where `tokens` and the encoded conversation differ,
      or None when they are equal: equality holds when the model's tokens
      are the tokenizer's own encoding of their text and the marker is one
      token; a byte tokenizer's eos stop, or a turn the tokenizer would have
      split otherwise, shows up here.
    """
    ended = messages[-1]["role"] == "assistant"
    segments = self.chat_template.segments(messages, add_generation_prompt=not ended)
    if ended:  # an episode ends with the model's turn: the layout the template writes after it is not sampled
      segments = segments[:max(i for i, (_, is_target) in enumerate(segments) if is_target) + 1]
    pieces = ["".join(text for text, _ in segments)] if one_text else [text for text, _ in segments]
    bos = [self.tokenizer.bos_id] if self.chat_template.add_bos and self.tokenizer.bos_id is not None else []
    whole = bos + [t for piece in pieces for t in self.tokenizer.encode(piece)]
    tokens = list(tokens)
    for i, (a, b) in enumerate(zip(whole, tokens)):
      if a != b:
        return i
    return None if len(whole) == len(tokens) else min(len(whole), len(tokens))
