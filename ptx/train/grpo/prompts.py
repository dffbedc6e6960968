"""Prompt batches for GRPO: left-padded prompts plus the batch's tasks (in-graph targets or host records).

Batch s holds tasks s * B .. (s + 1) * B - 1 of a random-access task source
(e.g. `ArithmeticTask`, or `JsonlTasks` over a file of "rl" records, read
in order and repeated), so the iterator's state is one integer and a
checkpoint resumes the prompt stream exactly. A task's prompt is encoded
once, here, by one of two encoders: `RecordPrompts`, as `ptx.data.records`
encodes an "rl" record (bos + text, or chat messages through the chat
template with the generation prompt), for the fused and host-reward steps;
`EpisodePrompts`, the first prompt an episode of the task shows in its
environment (the environment's text as a user turn of the chat template,
as `ptx.episodes.loop.play` encodes it), for multi-turn episodes, whose
records need no "prompt" field (docqa's). A string prompt gets no chat
template: for an instruct model, write the prompt as chat messages.
`JsonlTasks.check` reads every record once, before training, by the rules
the batches apply (and an environment's `validate`), so a bad record is
refused at startup, named by file and line.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol, Sequence

import grain
import numpy as np

from ptx.data import records
from ptx.data.sources import JsonlSource
from ptx.data.tokenizer import Tokenizer
from ptx.envs.base import Environment, first_prompt
from ptx.episodes.turn_format import TurnFormat
from ptx.train.grpo.token_rewards import encode_targets


class PromptEncoder(Protocol):
  """Encodes a task's prompt: token ids, or a ValueError naming the bad field."""

  # What the prompt is, for errors ("field 'prompt'").
  what: str

  def __call__(self, task: Mapping[str, Any]) -> Sequence[int]: ...


@dataclasses.dataclass(frozen=True)
class RecordPrompts:
  """An rl record's "prompt" as the data layer encodes it: bos + text, or chat messages through the chat template
  (the tokenizer's, else ChatML) with the generation prompt (`ptx.data.records`)."""

  tokenizer: Tokenizer
  what: str = "field 'prompt'"

  def __call__(self, task: Mapping[str, Any]) -> Sequence[int]:
    try:
      return records.encode("rl", self.tokenizer, dict(task), "")["tokens"]
    except records.RecordError as e:
      raise ValueError(e.reason) from None


@dataclasses.dataclass(frozen=True)
class EpisodePrompts:
  """The first prompt of an episode of a task in `env`: the environment's text (`ptx.envs.base.first_prompt`) as a
  user turn in `fmt`'s chat template, with the generation prompt (`TurnFormat.prompt`)."""

  env: Environment
  fmt: TurnFormat
  what: str = "its episode's first prompt"

  def __call__(self, task: Mapping[str, Any]) -> Sequence[int]:
    return self.fmt.prompt(first_prompt(self.env, task))


class JsonlTasks:
  """Task records of JSONL files as a random-access, endlessly repeating source.

  Args:
    paths: the JSONL files, read in order as one sequence.
    task_fields: fields each record must carry (e.g. ("answer",)); the prompt is its encoder's to require.
  """

  def __init__(self, paths: str | Sequence[str], task_fields: Sequence[str] = ()):
    self._source = JsonlSource(paths)  # a NoDataError for files without records
    self._fields = tuple(task_fields)

  def __getitem__(self, index: int) -> dict[str, Any]:
    raw = self._source[index % len(self._source)]
    record = records.decode(raw)
    missing = [f for f in self._fields if f not in record]
    if missing:
      raise records.RecordError(raw.where, f"missing field {missing[0]!r}")
    return {**record, "where": raw.where}

  def check(self, prompts: PromptEncoder, prompt_len: int,
            validate: Callable[[Mapping[str, Any]], None] | None = None) -> None:
    """Reads every record once, as the prompt batches will, and checks its fields; runs no task code.

    Args:
      prompts: encodes the prompts, as the batches will (`RecordPrompts`, `EpisodePrompts`).
      prompt_len: the most tokens a prompt may take (`PromptBatches`).
      validate: an environment's `validate`, raising ValueError for a bad task field; None checks none.

    Raises:
      RecordError: the first bad record, named by file and line.
    """
    for index in range(len(self._source)):
      record = self[index]
      where = record.pop("where")
      prompt_tokens(prompts, record, prompt_len, where)
      if validate is not None:
        try:
          validate(record)
        except ValueError as e:
          raise records.RecordError(where, str(e)) from None


def prompt_tokens(prompts: PromptEncoder, task: Mapping[str, Any], prompt_len: int, where: str) -> np.ndarray:
  """The token ids of a task's prompt; a RecordError naming `where` for a bad one, or one longer than `prompt_len`."""
  try:
    ids = np.asarray(prompts(task), np.int32)
  except ValueError as e:
    raise records.RecordError(where, str(e)) from None
  if len(ids) > prompt_len:
    raise records.RecordError(where, f"{prompts.what} takes {len(ids)} tokens, more than prompt_len={prompt_len} "
                              f"(data.seq_len: set data.seq_len={len(ids)} or more)")
  return ids


def longest_prompt(prompts: PromptEncoder, tasks: Any, count: int) -> tuple[int, int]:
  """(index, tokens) of the longest prompt of tasks 0 .. count - 1 (the first of equals).

  Raises:
    RecordError: for a task the encoder refuses, named by its index.
  """
  lengths = [len(prompt_tokens(prompts, tasks[i], np.iinfo(np.int32).max, f"task {i}")) for i in range(count)]
  index = int(np.argmax(lengths))
  return index, lengths[index]


class PromptBatches(grain.DatasetIterator):
  """Yields {"prompts" [B, P], "prompt_lengths" [B] (numpy int32), "task": ...}.

  Args:
    tasks: random-access task records (with a "prompt", string or chat messages, for `RecordPrompts`).
    tokenizer: encodes prompts (and answers, for in-graph targets).
    batch_size: prompts per batch (B).
    prompt_len: P; a longer prompt is an error naming the task.
    answer_width: A: "task" is {"targets" [B, A]}, each record's "answer"
      then eos (`ptx.train.grpo.token_rewards`), for an in-graph reward; None:
      "task" is the list of the B records, for a host reward.
    prompts: encodes a task's prompt; None: `RecordPrompts(tokenizer)`.
  """

  def __init__(self, tasks: Callable[[int], Mapping[str, Any]] | Any, tokenizer: Tokenizer, *, batch_size: int,
               prompt_len: int, answer_width: int | None, prompts: PromptEncoder | None = None):
    super().__init__()
    self._tasks, self._tokenizer = tasks, tokenizer
    self._batch_size, self._prompt_len, self._answer_width = batch_size, prompt_len, answer_width
    self._prompts = prompts or RecordPrompts(tokenizer)
    self._next = 0

  def __next__(self) -> dict[str, Any]:
    first = self._next * self._batch_size
    rows = [dict(self._tasks[first + i]) for i in range(self._batch_size)]
    self._next += 1
    prompts = np.full((self._batch_size, self._prompt_len), self._tokenizer.pad_id, np.int32)
    lengths = np.zeros(self._batch_size, np.int32)
    for i, row in enumerate(rows):
      ids = prompt_tokens(self._prompts, row, self._prompt_len, row.pop("where", f"task {first + i}"))
      prompts[i, self._prompt_len - len(ids):] = ids
      lengths[i] = len(ids)
    if self._answer_width is None:
      task: Any = rows
    else:
      task = {"targets": encode_targets(self._tokenizer, [str(r["answer"]) for r in rows], self._answer_width)}
    return {"prompts": prompts, "prompt_lengths": lengths, "task": task}

  def get_state(self) -> dict[str, Any]:
    return {"next_batch": self._next}

  def set_state(self, state: dict[str, Any]) -> None:
    self._next = int(state["next_batch"])
