"""Long-document question answering through a retrieval tool: the document is searched, never shown whole.

Task records are `{"document": str, "question": str, "answer": str}`, the
document's passages separated by blank lines (`DocQATasks` adds `"doc"`, its
document's key). The document text travels in the record, rather than being
regenerated from a key, so a record means the same thing whatever version of
the generator reads it, and records of real documents (rl records from files)
work unchanged; a generated record is about 12 KB of JSON.

`DocQATasks(seed, split)[i]` builds a fictional ship registry (50 passages,
3,400-3,700 tokens of SmolLM2's vocabulary): each ship's code, captain, home
port and tonnage in sentences scattered over the passages, ship names that
share words ("the Kelnor Crest", "the Kelnor Star", "the Tornor Crest") and
sentences that name ships without any value. The question asks one value of one ship.
The document is a pure function of its key, and the split is by that key
(`ptx.data.splits`), so no held-out document is ever trained on; tasks draw
keys from a pool of `documents`, so one document asks many questions.

An episode's first prompt is the instructions, the question and the
`prompt_passages` passages that rank best for it, within `prompt_tokens`
(`ptx.envs.context_builder`). In each turn the model calls tools in its
family's format (`ptx.envs.tools`): `search(query)` ranks the passages by BM25
over their words and shows the top `top_k`; `read(passage)` shows one
passage by number. The reply is a status line per call (errors name what was
wrong), then the passages found that the model has not seen whole, then a
line per earlier call, within `reply_tokens`. A turn without tool calls that
holds `Answer: <text>` ends the episode: reward 1.0 when the text equals the
answer after normalisation (case, surrounding punctuation and spaces).

What the reward cannot be fooled by: answers come from large spaces (codes
like KX-4821, generated names) and every value is unique in its document, so
guessing fails; only a tool-free turn answers, with exactly one `Answer:`
line, matched exactly (a list of candidates or a pasted passage is wrong);
every sentence that holds a value names its ship, and the document never
says "answer", so searching for the answer itself finds nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ptx.data import splits
from ptx.data.tokenizer import Tokenizer
from ptx.envs.context_builder import ContextBuilder
from ptx.envs.base import Outcome, Step, field
from ptx.envs.tools import FORMATS, Call, Tool, ToolRegistry

_ANSWER = re.compile(r"Answer:[ \t]*(.*)")
_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset("a an and at by did does for from how in is it many much of on or out the to under was what which "
                  "who whom with".split())
_MAX_QUERY_CHARS = 200
# Room in a reply for the notes on what is left out: under 100 bytes, so under 100 tokens in any tokenizer whose
# tokens each cover a byte or more.
_NOTES_TOKENS = 100
_BM25_K1, _BM25_B = 1.2, 0.75  # the usual BM25 constants (Robertson and Zaragoza)

_SYLLABLES = ("ar", "bel", "cor", "dan", "el", "fen", "gar", "hal", "is", "jor", "kel", "lun", "mar", "nor", "ol",
              "pel", "quin", "ros", "sel", "tor", "ul", "ven", "wyn", "zar")
_NOUNS = ("Lantern", "Crest", "Drift", "Star", "Heron", "Anchor", "Gale", "Thistle", "Marlin", "Ember")
_FIRST_NAMES = ("Ada", "Bram", "Cora", "Dov", "Edda", "Finn", "Greta", "Hugo", "Ilse", "Jonas", "Kaia", "Lev",
                "Mira", "Nils", "Oona", "Per", "Runa", "Sven", "Tova", "Ulf")
# attribute: (sentences stating its value, the question, how a value is drawn)
_FACTS = {
    "code": (("The {name} is entered in the registry under code {value}.",
              "Registry code {value} belongs to the {name}."),
             "Under which registry code is the {name} entered?",
             lambda rng: f"{_letters(rng, 2)}-{int(rng.integers(1000, 10_000))}"),
    "captain": (("Command of the {name} passed to captain {value}.", "Captain {value} took the helm of the {name}."),
                "Who was given command of the {name}?",
                lambda rng: f"{_FIRST_NAMES[int(rng.integers(len(_FIRST_NAMES)))]} {_word(rng)}"
                            f"{('son', 'ley', 'ton', 'er')[int(rng.integers(4))]}"),
    "port": (("The {name} sails out of the port of {value}.", "The home port of the {name} is {value}."),
             "Out of which port does the {name} sail?",
             lambda rng: f"{_word(rng)}{('haven', 'mouth', 'stead', 'ford', 'by')[int(rng.integers(5))]}"),
    "tonnage": (("The {name} displaces {value} tons.", "Surveyors put the {name} at {value} tons."),
                "How many tons does the {name} displace?", lambda rng: str(int(rng.integers(10_000, 100_000)))),
}
_ASIDES = ("Harbour clerks often confused the {name} with the {other}.",
           "The {name} and the {other} once shared a berth.",
           "Several captains declined command of the {name} before the war.",
           "The registry lists the {name} among the ships refitted in the winter yards.")
_SENTENCES_PER_PASSAGE = 4


def _letters(rng: np.random.Generator, n: int) -> str:
  return "".join(chr(ord("A") + int(c)) for c in rng.integers(26, size=n))


def _word(rng: np.random.Generator) -> str:
  return "".join(_SYLLABLES[int(s)] for s in rng.integers(len(_SYLLABLES), size=int(rng.integers(2, 4)))).title()


def document(key: int, ships: int) -> tuple[list[str], list[tuple[str, str, str]]]:
  """The registry with key `key`: its passages, and its facts as (ship, attribute, value).

  Args:
    key: the document's identity; the document is a pure function of (key, ships).
    ships: ships in the registry (each gives five sentences).

  Returns:
    The passages (four sentences each) and the facts, four per ship.
  """
  rng = np.random.default_rng([0xD0C, key, ships])
  words = sorted({_word(rng) for _ in range(max(3, ships // 3))})
  pairs = rng.permutation(len(words) * len(_NOUNS))[:ships]
  names = [f"{words[p // len(_NOUNS)]} {_NOUNS[p % len(_NOUNS)]}" for p in pairs]
  facts, sentences, seen = [], [], set()
  for name in names:
    for attribute, (says, _, draw) in _FACTS.items():
      value = draw(rng)
      while value in seen:  # unique values: a value found is the answer for exactly one ship
        value = draw(rng)
      seen.add(value)
      facts.append((name, attribute, value))
      sentences.append(says[int(rng.integers(len(says)))].format(name=name, value=value))
  by_word = collections.defaultdict(list)
  for name in names:
    for w in name.split():
      by_word[w].append(name)
  for i, name in enumerate(names):
    # Another ship sharing a word of the name where there is one: a distractor for searches by name.
    similar = [n for w in name.split() for n in by_word[w] if n != name] or [names[i - 1]]
    other = similar[int(rng.integers(len(similar)))]
    aside = _ASIDES[int(rng.integers(len(_ASIDES)))]
    sentences.append(aside.format(name=name, other=other))
  order = rng.permutation(len(sentences))
  passages = [" ".join(sentences[j] for j in order[k:k + _SENTENCES_PER_PASSAGE])
              for k in range(0, len(order), _SENTENCES_PER_PASSAGE)]
  return passages, facts


@dataclasses.dataclass(frozen=True)
class DocQATasks:
  """Questions about generated registries, task i a pure function of (seed, i, split).

  Attributes:
    seed: selects the stream of documents and questions.
    split: "train" or "held_out" (`ptx.data.splits`: by the document's key).
    documents: the pool of document keys tasks draw from (each document asks many questions).
    ships: ships per document (four facts each).
  """

  seed: int = 0
  split: str = "train"
  documents: int = 4096
  ships: int = 40

  def __post_init__(self):
    splits.check("DocQATasks", self.split)
    if self.documents < 1 or self.ships < 2:
      raise ValueError(f"DocQATasks.documents must be >= 1 and ships >= 2, got {self.documents}, {self.ships}")

  def __getitem__(self, i: int) -> dict[str, Any]:
    """Task i: `{"doc", "document", "question", "answer"}`."""
    rng = np.random.default_rng([self.seed, i, splits.SPLITS.index(self.split)])

    def candidate():
      key = int(rng.integers(self.documents))
      return f"document {key}", key

    key = splits.draw("DocQATasks", self.split, candidate)
    passages, facts = document(key, self.ships)
    name, attribute, value = facts[int(rng.integers(len(facts)))]
    return {"doc": key, "document": "\n\n".join(passages), "question": _FACTS[attribute][1].format(name=name),
            "answer": value}


def _terms(text: str) -> list[str]:
  return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


class _Index:
  """BM25 over passages' words (lower-cased, stop words dropped); ties go to the earlier passage."""

  def __init__(self, passages: Sequence[str]):
    self.counts = [collections.Counter(_terms(p)) for p in passages]
    self.lengths = [sum(c.values()) for c in self.counts]
    self.mean_length = max(1.0, sum(self.lengths) / len(self.lengths))
    frequency = collections.Counter(t for c in self.counts for t in c)
    n = len(passages)
    self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in frequency.items()}

  def search(self, query: str, k: int) -> list[int]:
    """The indices of the (at most) k best passages with any of the query's words, best first."""
    terms = set(_terms(query)) & self.idf.keys()
    scores = []
    for i, (counts, length) in enumerate(zip(self.counts, self.lengths)):
      norm = _BM25_K1 * (1 - _BM25_B + _BM25_B * length / self.mean_length)
      score = sum(self.idf[t] * counts[t] * (_BM25_K1 + 1) / (counts[t] + norm) for t in terms if counts[t])
      if score > 0:
        scores.append((-score, i))
    return [i for _, i in sorted(scores)[:k]]


def normalise(text: str) -> str:
  """An answer's comparable form: NFKC, case-folded, outer quotes, marks and spaces stripped, spaces collapsed."""
  return " ".join(unicodedata.normalize("NFKC", text).casefold().strip().strip("\"'`*.,;:!? ").split())


class DocQAEpisode:
  """One attempt: searches and reads answered within the reply budget until a tool-free turn answers.

  Args:
    env: the settings (budgets, tools).
    passages: the document's passages, numbered from 1 for the model.
    question: what the first prompt asks.
    answer: what scores.
  """

  def __init__(self, env: DocQAEnv, passages: Sequence[str], question: str, answer: str):
    self.passages, self.answer, self.top_k, self.max_calls = passages, answer, env.top_k, env.max_calls
    self.index = _Index(passages)
    self.tools = ToolRegistry([
        Tool("search", f"Ranks the document's passages by the query's words; shows the best {env.top_k}.",
             {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}, self._search),
        Tool("read", f"Shows passage number `passage` (1 to {len(passages)}) whole.",
             {"type": "object", "properties": {"passage": {"type": "integer"}}, "required": ["passage"]},
             self._read)], env.tool_format, max_calls=env.max_calls)
    self.reply = ContextBuilder(env.tokenizer, env.reply_tokens, env.line_tokens)
    self.shown: set[int] = set()  # passages the model has seen whole
    self.history: list[str] = []  # a line per successful call of earlier turns
    self.found: list[tuple[int, bool]] = []  # this turn's passages to show: (index, even if seen)
    fixed = (f"Answer a question about a document of {len(passages)} numbered passages that you cannot see whole; "
             f"search it with the tools.\n{self.tools.instructions()}\nWhen you know the answer, reply with "
             "`Answer: <answer>` on one line and no tool call: the value only, as the document writes it."
             f"\n\nQuestion: {question}")
    hits = self.index.search(question, env.prompt_passages)
    try:
      message = ContextBuilder(env.tokenizer, env.prompt_tokens, env.line_tokens).compose(fixed, self._label(hits))
    except ValueError as e:
      raise ValueError(f"{env.name}: this task's instructions and question do not fit DocQAEnv.prompt_tokens: {e}") \
          from None
    self.prompt = message.text
    self.shown.update(hits[:message.passages_whole])

  def _label(self, indices: Sequence[int]) -> list[str]:
    return [f"[{i + 1}] {self.passages[i]}" for i in indices]

  def _search(self, query: str) -> str:
    if len(query) > _MAX_QUERY_CHARS:
      raise ValueError(f"the query is longer than {_MAX_QUERY_CHARS} characters")
    if not _terms(query):
      raise ValueError("the query has no words to search for (words like 'the' and 'is' are ignored)")
    hits = self.index.search(query, self.top_k)
    if not hits:
      return "no passage matches"
    self.found += [(i, False) for i in hits]
    return "passages " + ", ".join(f"{i + 1}{' (seen)' * (i in self.shown)}" for i in hits)

  def _read(self, passage: int) -> str:
    if not 1 <= passage <= len(self.passages):
      raise ValueError(f"passage must be between 1 and {len(self.passages)}, got {passage}")
    self.found.append((passage - 1, True))
    return f"passage {passage}"

  def step(self, action: str) -> Step:
    """Answers the turn's tool calls (counted in the Step), or scores its answer."""
    self.found = []
    results = self.tools.run(action)
    if results:
      return self._reply(results)
    answers = _ANSWER.findall(action)
    if not answers:
      return Step(observation="No tool call and no `Answer: <answer>` line found: search, read or answer.")
    if len(answers) > 1:
      return Step.final(Outcome.WRONG, f"{len(answers)} answers in one turn; exactly one counts")
    if normalise(answers[0]) == normalise(self.answer):
      return Step.final(Outcome.OK, f"{answers[0]!r} is right")
    return Step.final(Outcome.WRONG, f"{answers[0][:100]!r} is not {self.answer!r}")

  def _reply(self, results: Sequence[tuple[Call, str, bool]]) -> Step:
    """A status line per answered call, then the passages found that are new (or read), then the history."""
    lines = [self.reply.line(f"{_describe(call)}: {text}" if ok else text)
             for call, text, ok in results[:self.max_calls]]
    if len(results) > self.max_calls:
      lines.append(self.reply.line(f"error: {len(results) - self.max_calls} more tool calls not answered (at most "
                                   f"{self.max_calls} a turn)"))
    show = list(dict.fromkeys(i for i, forced in self.found if forced or i not in self.shown))
    message = self.reply.compose("\n".join(lines), self._label(show), self.history)
    self.shown.update(show[:message.passages_whole])
    self.history += [line for line, (_, _, ok) in zip(lines, results[:self.max_calls]) if ok]
    return Step(observation=message.text, tool_calls=len(results), tool_errors=sum(not ok for _, _, ok in results))

  def close(self) -> None:
    """Holds nothing."""


def _describe(call: Call) -> str:
  return f"{call.name}({', '.join(json.dumps(v) for v in call.arguments.values())})"


@dataclasses.dataclass(frozen=True)
class DocQAEnv:
  """Questions about a long document through search and read tools (see the module docstring).

  Attributes:
    tokenizer: the policy's tokenizer: the budgets count its tokens (their defaults suit BPE vocabularies, about 4
      characters a token).
    max_turns: turns per episode.
    tool_format: the model family's tool-call format (`ptx.envs.tools.FORMATS`).
    prompt_tokens: the first prompt's budget.
    prompt_passages: passages ranked for the question shown in the first prompt (the answer's passage ranks first
      for 31% of generated tasks, in the best two for 52%, three 67%: measured on DocQATasks()[:300]).
    reply_tokens: each tool reply's budget.
    top_k: passages a search shows.
    max_calls: tool calls answered per turn.
    line_tokens: the most tokens of a call's status line (and of each history line).
  """

  tokenizer: Tokenizer
  name: str = "docqa"
  max_turns: int = 6
  sandboxed: bool = False
  tool_format: str = "hermes"
  prompt_tokens: int = 1024
  prompt_passages: int = 2
  reply_tokens: int = 512
  top_k: int = 3
  max_calls: int = 4
  line_tokens: int = 40

  def __post_init__(self):
    if self.tool_format not in FORMATS:
      raise ValueError(f"DocQAEnv.tool_format must be one of {FORMATS}, got {self.tool_format!r}")
    if self.prompt_passages < 0:
      raise ValueError(f"DocQAEnv.prompt_passages must be >= 0, got {self.prompt_passages}")
    for name in ("max_turns", "prompt_tokens", "top_k", "max_calls", "line_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"DocQAEnv.{name} must be >= 1, got {getattr(self, name)}")
    # A reply's fixed part is a line per answered call and one for the rest; it must fit with the notes.
    least = (self.max_calls + 1) * (self.line_tokens + 1) + _NOTES_TOKENS
    if self.reply_tokens < least:
      raise ValueError(f"DocQAEnv.reply_tokens must be >= (max_calls + 1) * (line_tokens + 1) + {_NOTES_TOKENS} = "
                       f"{least} to hold a turn's status lines, got {self.reply_tokens}")

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks a `{"document", "question", "answer"}` record's fields (whether the question fits `prompt_tokens` is
    found at `reset`)."""
    self._passages(task)

  def reset(self, task: Mapping[str, Any]) -> DocQAEpisode:
    """Starts an episode for a `{"document", "question", "answer"}` record."""
    return DocQAEpisode(self, self._passages(task), task["question"], task["answer"])

  def _passages(self, task: Mapping[str, Any]) -> list[str]:
    """The document's passages, the record's fields checked."""
    text = field(task, "document", str, self.name)
    field(task, "question", str, self.name)
    field(task, "answer", str, self.name)
    passages = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not passages:
      raise ValueError(f"{self.name} task field 'document' has no passages (they are separated by blank lines)")
    return passages
