"""The context builder: never over budget, fixed text whole, passages by rank, history merged oldest first."""

import random

import pytest

from ptx.data.tokenizer import ByteTokenizer
from ptx.envs.context_builder import ContextBuilder

_BASE = 0x110000  # one more than the largest code point


class PairTokenizer:
  """Two characters a token (the last maybe one): a message's count is not the sum of its parts' counts."""

  def encode(self, text):
    return [ord(text[i]) if i + 1 == len(text) else (ord(text[i]) + 1) * _BASE + ord(text[i + 1])
            for i in range(0, len(text), 2)]

  def decode(self, ids):
    return "".join(chr(i) if i < _BASE else chr(i // _BASE - 1) + chr(i % _BASE) for i in ids)


def _text(rng, most):
  # Multi-byte characters too, so a byte-level cut can fall inside one.
  return "".join(rng.choice("abc de\né→") for _ in range(rng.randrange(most)))


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), PairTokenizer()], ids=["bytes", "pairs"])
def test_a_message_never_exceeds_the_budget_and_keeps_its_parts_in_order(tokenizer):
  rng = random.Random(0)
  refused = 0
  for _ in range(300):
    fixed = _text(rng, 60)
    passages = [f"[{i}] {_text(rng, 120)}" for i in range(rng.randrange(6))]
    history = [_text(rng, 50) for _ in range(rng.randrange(6))]
    builder = ContextBuilder(tokenizer, rng.randrange(1, 400), line_tokens=rng.randrange(4, 30),
                             min_cut_tokens=rng.randrange(1, 20))
    try:
      message = builder.compose(fixed, passages, history)
    except ValueError as e:
      assert "fixed is" in str(e) and f"ContextBuilder.budget={builder.budget}" in str(e)
      refused += 1
      continue
    assert message.tokens == len(tokenizer.encode(message.text)) <= builder.budget
    assert message.text.startswith(fixed)
    assert message.passages_whole + message.passage_cut + message.passages_left_out == len(passages)
    assert message.history_shown + message.history_merged == len(history)
    at = [message.text.index(p) for p in passages[:message.passages_whole]]
    assert at == sorted(at)
    if message.passages_left_out:
      assert f"[{message.passages_left_out} more passage" in message.text
  assert 10 < refused < 290  # both branches ran


def test_passages_go_whole_by_rank_then_one_is_cut_and_the_rest_counted():
  builder = ContextBuilder(ByteTokenizer(), 139, min_cut_tokens=10)
  passages = ["[1] " + "a" * 36, "[2] " + "b" * 36, "[3] " + "c" * 36, "[4] " + "d" * 36]
  message = builder.compose("F" * 10, passages)
  # 10 fixed + 2 * (2 + 40) whole, then [3] cut to the 139 - 94 - 2 - 6 - 27 tokens left beside its mark and the note.
  assert message.text == ("F" * 10 + "\n\n" + passages[0] + "\n\n" + passages[1] + "\n\n[3] " + "c" * 6 + " [cut]"
                          "\n\n[1 more passage left out]")
  assert message.tokens == 139 and (message.passages_whole, message.passage_cut, message.passages_left_out) == (2, 1, 1)
  # Too little room for min_cut_tokens of [3]: it is dropped, and [4], though it would be cut too, is not tried.
  strict = ContextBuilder(ByteTokenizer(), 139, min_cut_tokens=20).compose("F" * 10, passages)
  assert strict.text.endswith(passages[1] + "\n\n[2 more passages left out]") and not strict.passage_cut
  # Room for everything: no notes.
  roomy = ContextBuilder(ByteTokenizer(), 500).compose("F" * 10, passages)
  assert roomy.text == "\n\n".join(["F" * 10, *passages]) and roomy.passages_left_out == 0


def test_a_cut_falls_on_a_token_boundary_and_never_shows_half_a_character():
  for budget in range(28, 70):  # cuts at odd and even byte counts of two-byte characters
    message = ContextBuilder(ByteTokenizer(), budget, min_cut_tokens=4).compose("F", ["é" * 40])
    cut = message.text.split("\n\n")[1]
    assert cut.endswith(" [cut]") and set(cut.removesuffix(" [cut]")) == {"é"} and "\ufffd" not in message.text
  paired = ContextBuilder(PairTokenizer(), 14, min_cut_tokens=2).compose("F", ["abcdefghijklmnopqrstuvwxyz"])
  # The passage's tokens are pairs: a cut keeps an even number of its characters (20 would make 29 in all: 15 tokens).
  assert paired.text == "F\n\nabcdefghijklmnopqr [cut]" and paired.tokens == 14


def test_history_keeps_the_newest_lines_and_merges_the_oldest_into_a_count():
  builder = ContextBuilder(ByteTokenizer(), 200, line_tokens=30)
  history = [f"search(q{i}): passages {i}, {i + 1}" for i in range(6)]
  full = ContextBuilder(ByteTokenizer(), 1000).compose("F", ["p"], history)
  assert full.text == "F\n\np\n\nEarlier in this episode:\n" + "\n".join(f"- {h}" for h in history)
  short = builder.compose("F" * 60, ["p" * 20], history)
  assert 0 < short.history_shown < 6 and short.history_merged == 6 - short.history_shown
  assert f"- ({short.history_merged} earlier lines not shown)\n- search(q{short.history_merged})" in short.text
  assert short.text.endswith(f"- {history[-1]}") and short.tokens <= 200
  # Passages come before history: a passage that fills the room leaves only the count.
  crowded = builder.compose("F", ["p" * 500], history)
  assert crowded.text.endswith("Earlier in this episode:\n- (6 earlier lines not shown)") and crowded.passage_cut


def test_a_history_line_is_one_short_line():
  builder = ContextBuilder(ByteTokenizer(), 100, line_tokens=24)
  assert builder.line("search(a\nb):\tpassages 1") == "search(a b): passages 1"
  long = builder.line("x" * 100)
  assert long == "x" * 20 + " …" and builder.count(long) == 24  # "…" is 3 bytes


def test_errors_name_the_field():
  with pytest.raises(ValueError, match=r"fixed is 50 tokens.*ContextBuilder.budget=40"):
    ContextBuilder(ByteTokenizer(), 40).compose("F" * 50)
  # The fixed part fits, but not with the note saying what was left out (38 + 2 + 25 tokens).
  with pytest.raises(ValueError, match=r"fixed is 38 tokens; with the notes on what is left out the message needs 65"):
    ContextBuilder(ByteTokenizer(), 40).compose("F" * 38, ["passage"])
  for name in ("budget", "line_tokens", "min_cut_tokens"):
    with pytest.raises(ValueError, match=f"ContextBuilder.{name} must be >= 1, got 0"):
      ContextBuilder(ByteTokenizer(), **{"budget": 10, name: 0})
