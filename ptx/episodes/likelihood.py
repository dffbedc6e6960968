"""Log-likelihood scoring: continuations given contexts, long texts in windows, multiple choice, perplexity.

`Scorer` scores token pairs (context, continuation) with one jitted
program, `continuation_scores`: the decoder's float32 log-probs of every
next token (`ptx.models.chunked_logits.token_stats`, the training loss's own
forward), summed over the continuation, and whether every continuation
token was the argmax of its prediction (lm-evaluation-harness's
`is_greedy`). Pairs are sorted by length and right-padded into a few shapes
(lengths and rows rounded up to powers of two, `ptx.sampling.buckets`), so
a whole evaluation compiles a handful of programs; on a mesh the rows are
split over its devices.

Text becomes tokens as lm-evaluation-harness's causal models do
(`encode_pair`): trailing whitespace of the context moves to the
continuation, the continuation is what encoding context + continuation
adds after the context's own tokens, and every scored sequence starts with
the prefix token (bos, or eos where the vocabulary has no bos). A scored
sequence spans at most `max_length` positions: a longer pair keeps its last
`max_length` tokens (the context is cut from the left).

`rolling_windows` splits a long text for `loglikelihood_rolling`: disjoint
windows that score every token exactly once, each with as much context as
fits (lm-eval's `get_rolling_token_windows` with `max_seq_len` =
`max_length - 1` and `make_disjoint_window`).

Two evaluation suites read files (`ptx eval --task choice|perplexity`,
`eval.suites` at checkpoints): `choice`, JSONL records `{"context",
"choices", "answer"}` (each choice scored as written, as the continuation
of the context; `answer` the index of the right one), reported as acc (the
argmax of the summed log-prob), acc_norm (of the log-prob per character of
the choice, lm-eval's acc_norm) and acc_bytes (per UTF-8 byte); and
`perplexity`, documents (a `.jsonl` file's `"text"` fields, or a whole
text file as one), reported as token perplexity, byte perplexity and bits
per byte over all documents. A choice report reads as a sampled suite's
with k = 1 (pass@1 = mean@k = acc), so `--compare` and checkpoint
regressions use acc; a perplexity report is compared by bits per byte
(`ptx.episodes.evaluation.headline`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ptx import paths, sharding
from ptx.data.records import RecordError, decode
from ptx.data.sources import JsonlSource
from ptx.data.tokenizer import Tokenizer, check_fits
from ptx.model_config import ModelConfig
from ptx.models.chunked_logits import token_stats
from ptx.sampling import buckets

# Positions a scored sequence may span when the model declares no context length (lm-eval's HF default).
WINDOW = 2048
# The shortest padded length: pairs of a few tokens share one program.
_MIN_LENGTH = 16


def continuation_scores(params: Any, tokens: jax.Array, segment_ids: jax.Array, scored: jax.Array, *,
                        cfg: ModelConfig, rules: sharding.Rules) -> tuple[jax.Array, jax.Array]:
  """Summed log-probs [B] of each row's scored tokens, and whether each of them was its prediction's argmax [B].

  Args:
    params: the decoder's parameter tree.
    tokens: int32 [B, T], each row right-padded.
    segment_ids: int32 [B, T], 1 on a row's tokens, 0 on its padding.
    scored: bool [B, T], the continuation's tokens (each scored given the tokens before it).
    cfg: the model config.
    rules: the sharding rules.
  """
  stats, _ = token_stats(params, tokens, cfg, segment_ids=segment_ids, rules=rules)  # float32 log-probs
  return jnp.where(scored, stats.log_probs, 0.0).sum(axis=-1), jnp.all(stats.correct | ~scored, axis=-1)


_scores_jit = jax.jit(continuation_scores, static_argnames=("cfg", "rules"))


def rolling_windows(tokens: Sequence[int], prefix: int, max_length: int,
                    context: int = 1) -> list[tuple[list[int], list[int]]]:
  """Disjoint (context, continuation) windows of at most `max_length` tokens that score each of `tokens` once.

  The first window is the prefix token and the first `max_length - 1`
  tokens; each later one scores up to `max_length - context` new tokens after
  as many earlier tokens as fit (at least `context`).
  """
  if not 1 <= context < max_length:
    raise ValueError(f"rolling_windows: context must be in 1..{max_length - 1}, got {context}")
  tokens = list(tokens)
  windows, done = [], min(len(tokens), max_length - 1)
  if tokens:
    windows.append(([prefix], tokens[:done]))
  while done < len(tokens):
    end = min(len(tokens), done + max_length - context)
    windows.append((tokens[max(0, end - max_length):done], tokens[done:end]))
    done = end
  return windows


@dataclasses.dataclass
class Scorer:
  """Scores text and token continuations under a parameter tree.

  Attributes:
    params: the decoder parameters (placed on `mesh` when given).
    cfg: the model config.
    tokenizer: encodes the texts.
    max_length: positions a scored sequence may span.
    batch_size: rows per call of the program, at most.
    mesh: score sharded on this mesh (rows over its batch axes); None: one device.
    rules: the sharding rules `params` were placed by.
  """

  params: Any
  cfg: ModelConfig
  tokenizer: Tokenizer
  max_length: int = WINDOW
  batch_size: int = 16
  mesh: Mesh | None = None
  rules: sharding.Rules = sharding.DEFAULT_RULES

  def __post_init__(self):
    check_fits(self.tokenizer, self.cfg.vocab_size, "Scorer")
    if self.max_length < 2 or self.batch_size < 1:
      raise ValueError(f"Scorer: max_length must be >= 2 and batch_size >= 1, got {self.max_length}, "
                       f"{self.batch_size}")

  @property
  def prefix(self) -> int:
    """The token every scored sequence starts with: bos, or eos for a vocabulary without one."""
    return self.tokenizer.eos_id if self.tokenizer.bos_id is None else self.tokenizer.bos_id

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(prefix + context tokens, continuation tokens), split as lm-evaluation-harness's causal models split them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    own = self.tokenizer.encode(context)
    return [self.prefix] + own, self.tokenizer.encode(context + continuation)[len(own):]

  def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
    """(log p(continuation | context), is greedy) of each (context, continuation) text pair."""
    return self.score_tokens([self.encode_pair(c, x) for c, x in pairs])

  def rolling(self, texts: Sequence[str]) -> list[float]:
    """The log-likelihood of each text after the prefix token, scored in `rolling_windows` of `max_length`."""
    return self.rolling_tokens([self.tokenizer.encode(t) for t in texts])

  def rolling_tokens(self, texts: Sequence[Sequence[int]]) -> list[float]:
    """`rolling` of texts already encoded."""
    windows = [rolling_windows(ids, self.prefix, self.max_length) for ids in texts]
    scores = iter(self.score_tokens([w for text in windows for w in text]))
    return [sum(next(scores)[0] for _ in text) for text in windows]

  def score_tokens(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
    """(summed log-prob, is greedy) of each (context ids, continuation ids) pair, in order.

    Raises:
      ValueError: naming the pair, for an empty context or continuation, or
        a continuation of `max_length` tokens or more.
    """
    rows = []
    for index, (context, continuation) in enumerate(pairs):
      if not context or not continuation or len(continuation) >= self.max_length:
        raise ValueError(f"pair {index}: needs a context and 1..{self.max_length - 1} continuation tokens, got "
                         f"{len(context)} and {len(continuation)}")
      rows.append((list(context) + list(continuation))[-self.max_length:])
    out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    devices = 1 if self.mesh is None else self.mesh.devices.size
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    padded = lambda i: min(buckets.bucket(len(rows[i]), _MIN_LENGTH), self.max_length)  # noqa: E731
    while order:  # the longest first: the rows of one call share a padded length
      length = padded(order[0])
      group = [i for i in order[:self.batch_size] if padded(i) == length]
      order = order[len(group):]
      scores, greedy = self._run([rows[i] for i in group], [len(pairs[i][1]) for i in group], length, devices)
      for row, i in enumerate(group):
        out[i] = (float(scores[row]), bool(greedy[row]))
    return out

  def _run(self, rows: list[list[int]], scored: list[int], length: int, devices: int):
    """The program on `rows` padded to [a bucket of rows, `length`], the last `scored` tokens of each scored."""
    n = -(-buckets.bucket(len(rows)) // devices) * devices  # the batch axes divide the mesh's size
    tokens = np.full((n, length), self.tokenizer.pad_id, np.int32)
    segments, mask = np.zeros((n, length), np.int32), np.zeros((n, length), bool)
    for r, (row, k) in enumerate(zip(rows, scored)):
      tokens[r, :len(row)], segments[r, :len(row)], mask[r, len(row) - k:len(row)] = row, 1, True
    arrays = (tokens, segments, mask)
    context = contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)
    if self.mesh is not None:
      arrays = tuple(jax.device_put(a, sharding.batch_sharding(self.mesh, 2, self.rules)) for a in arrays)
    with context:
      scores, greedy = _scores_jit(self.params, *arrays, cfg=self.cfg, rules=self.rules)
    return np.asarray(scores), np.asarray(greedy)


def read_choices(path: str | os.PathLike, n: int) -> list[dict[str, Any]]:
  """The first `n` multiple-choice records of a JSONL file, checked.

  Raises:
    RecordError: naming the file, line and field of a record without a
      string "context", a list of two or more non-empty string "choices",
      or an integer "answer" indexing them.
  """
  source, records = JsonlSource(path), []
  for i in range(min(n, len(source))):
    raw = source[i]
    record = decode(raw)
    choices = record.get("choices")
    if not isinstance(record.get("context"), str):
      raise RecordError(raw.where, "field 'context': needs a string")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
      raise RecordError(raw.where, "field 'choices': needs a list of two or more non-empty strings")
    answer = record.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
      raise RecordError(raw.where, f"field 'answer': needs the index of the right choice, 0..{len(choices) - 1}, "
                        f"got {answer!r}")
    records.append(record)
  return records


def read_texts(path: str | os.PathLike, n: int) -> list[str]:
  """The first `n` documents of a file: the "text" of each JSONL record (`.jsonl`), or the whole file.

  Raises:
    RecordError: naming the file and line of a record without a non-empty string "text", or an empty text file.
  """
  path = paths.path(path)
  if path.suffix != ".jsonl":
    text = path.read_text()
    if not text:
      raise RecordError(str(path), "an empty text file has nothing to score")
    return [text]
  source, texts = JsonlSource(path), []
  for i in range(min(n, len(source))):
    raw = source[i]
    text = decode(raw).get("text")
    if not isinstance(text, str) or not text:
      raise RecordError(raw.where, "field 'text': needs a non-empty string")
    texts.append(text)
  return texts


def choice_report(scorer: Scorer, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Scores every choice of every record; the report of acc, acc_norm and acc_bytes (see the module docstring)."""
  pairs = [(r["context"], choice) for r in records for choice in r["choices"]]
  scores = iter(scorer.loglikelihood(pairs))
  per_task, hits = [], {"acc": 0, "acc_norm": 0, "acc_bytes": 0}
  for index, record in enumerate(records):
    logps = np.array([next(scores)[0] for _ in record["choices"]])
    chars = np.array([len(c) for c in record["choices"]], np.float64)
    size = np.array([len(c.encode("utf-8")) for c in record["choices"]], np.float64)
    picks = {"acc": int(np.argmax(logps)), "acc_norm": int(np.argmax(logps / chars)),
             "acc_bytes": int(np.argmax(logps / size))}
    for name, pick in picks.items():
      hits[name] += pick == record["answer"]
    per_task.append({"index": index, "answer": record["answer"], "log_likelihoods": logps.tolist(),
                     **{f"pick_{name}": pick for name, pick in picks.items()}})
  acc = hits["acc"] / len(records)
  return {"env": "choice", "tasks": len(records), "k": 1, "pass@k": {"1": acc}, "mean@k": acc,
          "outcomes": {"ok": hits["acc"], "wrong": len(records) - hits["acc"]},
          **{name: count / len(records) for name, count in hits.items()}, "per_task": per_task}


def perplexity_report(scorer: Scorer, texts: Sequence[str]) -> dict[str, Any]:
  """Scores each document in rolling windows; the report of token and byte perplexity and bits per byte."""
  encoded = [scorer.tokenizer.encode(t) for t in texts]
  logls = scorer.rolling_tokens(encoded)
  tokens = [len(ids) for ids in encoded]
  size = [len(t.encode("utf-8")) for t in texts]
  total = sum(logls)
  return {"env": "perplexity", "tasks": len(texts), "tokens": sum(tokens), "bytes": sum(size),
          "log_likelihood": total, "token_perplexity": math.exp(-total / sum(tokens)),
          "byte_perplexity": math.exp(-total / sum(size)), "bits_per_byte": -total / sum(size) / math.log(2),
          "max_length": scorer.max_length,
          "per_task": [{"index": i, "tokens": t, "bytes": b, "log_likelihood": ll}
                       for i, (t, b, ll) in enumerate(zip(tokens, size, logls))]}


# The suites of this module (`ptx eval --task NAME`, `eval.suites`): (read the first n records of a file, report).
SUITES = {"choice": (read_choices, choice_report), "perplexity": (read_texts, perplexity_report)}
