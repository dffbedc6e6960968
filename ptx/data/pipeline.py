"""The grain pipeline from a record source to host-local [B, T] batches.

    source -> seeded shuffle (a new order each epoch) -> repeat
      -> this host's shard (every process_count-th element, from process_index)
      -> decode + validate + tokenize + fit to T   (grain threads)
      -> first-fit packing (or one sequence per row) -> [B / process_count, T]

Every stage before packing is a grain `MapDataset`, so element i of a host's
stream is a pure function of (source, seed, i). The batching iterator's state
is the reader's position, the keys of the sequences waiting in open rows and
the counters; restoring re-reads those few sequences by key, so a resumed run
yields exactly the batches of an uninterrupted one. The iterator is a grain
`DatasetIterator`: `grain.checkpoint.CheckpointSave/CheckpointRestore` save
and restore it with Orbax.

Bad records follow `on_error`: "raise" stops with a `RecordError` naming the
file and line; "skip" drops the record, logs it and counts it in
`metrics()["skipped"]`. Records longer than T follow `overlong`: "truncate"
keeps the first T tokens (`truncated`), "drop" drops them (`dropped`); a
truncation that leaves no target token, and any overlong RL prompt (whose
question would be cut), is dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Literal, Sequence

import grain
import numpy as np

from ptx.data.batch import pack_rows
from ptx.data.chat import ChatTemplate
from ptx.data.packing import BinPool
from ptx.data.records import KINDS, RecordError, decode, encode
from ptx.data.sources import RawRecord
from ptx.data.tokenizer import Tokenizer

_COUNTERS = ("records", "skipped", "truncated", "dropped", "sequences", "tokens", "slots")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """How records become batches."""

  # Record kind: "sft", "preference" or "rl" (see ptx.data.records).
  kind: Literal["sft", "preference", "rl"] = "sft"
  # Sequences per step over all hosts; each host makes batch_size / process_count.
  batch_size: int = 16
  # Tokens per row (T).
  seq_len: int = 2048
  # First-fit packing of several sequences per row ("sft" only); else one per row.
  pack: bool = True
  # Open rows of the packer per host (more: denser, more held back).
  num_bins: int = 64
  # Seed of the shuffle; each epoch gets its own order from it.
  seed: int = 0
  # Shuffle records (off: source order).
  shuffle: bool = True
  # Passes over the source; None repeats forever.
  num_epochs: int | None = None
  # Bad records: "raise" (error naming file and line) or "skip" (counted).
  on_error: Literal["raise", "skip"] = "raise"
  # Records longer than seq_len: "truncate" (keep the head) or "drop" (counted).
  overlong: Literal["truncate", "drop"] = "truncate"
  # Fields an "rl" record must carry for its environment (e.g. ("answer",)).
  task_fields: tuple[str, ...] = ()
  # Reader threads for decoding and tokenizing.
  num_threads: int = 2
  # Elements read ahead of the packer.
  prefetch: int = 128

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"PipelineConfig.kind must be one of {KINDS}, got {self.kind!r}")
    if self.on_error not in ("raise", "skip") or self.overlong not in ("truncate", "drop"):
      raise ValueError(f"PipelineConfig: bad policy on_error={self.on_error!r} overlong={self.overlong!r}")
    if self.pack and self.kind != "sft":
      raise ValueError(f"PipelineConfig: packing is for sft records; set pack=False for {self.kind!r}")


def make_pipeline(source: Sequence[RawRecord], tokenizer: Tokenizer, cfg: PipelineConfig, *,
                  template: ChatTemplate | None = None, process_index: int = 0,
                  process_count: int = 1) -> "BatchDataset":
  """Builds this host's pipeline.

  Args:
    source: a random-access source (`ptx.data.sources`).
    tokenizer: any `Tokenizer`.
    cfg: the pipeline configuration.
    template: chat template for `messages` records (default: the
      tokenizer's, else ChatML).
    process_index: this host (`jax.process_index()` on a real job).
    process_count: hosts (`jax.process_count()`).

  Returns:
    An iterable whose iterators yield host-local batches and have
    `get_state`, `set_state` and `metrics`.
  """
  if cfg.batch_size % process_count:
    raise ValueError(f"batch_size {cfg.batch_size} does not split over {process_count} processes")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} outside 0..{process_count - 1}")
  ds = grain.MapDataset.source(source)
  if cfg.shuffle:
    ds = ds.seed(cfg.seed).shuffle()
  ds = ds.repeat(cfg.num_epochs)[process_index::process_count]
  prepare = functools.partial(_prepare, tokenizer=tokenizer, cfg=cfg, template=template)
  return BatchDataset(ds.map(prepare), cfg, tokenizer.pad_id, cfg.batch_size // process_count)


class BatchDataset(grain.IterDataset):
  """Packs or pads a MapDataset of prepared examples into host batches."""

  def __init__(self, examples: grain.MapDataset, cfg: PipelineConfig, pad_id: int, batch_size: int):
    super().__init__()
    self.examples = examples
    self.cfg = cfg
    self.pad_id = pad_id
    self.batch_size = batch_size

  def __iter__(self) -> "BatchIterator":
    return BatchIterator(self)


class BatchIterator(grain.DatasetIterator):
  """Yields host batches; its state resumes the stream exactly."""

  def __init__(self, ds: BatchDataset):
    options = grain.ReadOptions(num_threads=ds.cfg.num_threads, prefetch_buffer_size=ds.cfg.prefetch)
    super().__init__(iter(ds.examples.to_iter_dataset(options)))
    self._ds = ds
    self._pool = BinPool(ds.cfg.seq_len, ds.cfg.num_bins)
    self._examples: dict[int, dict[str, Any]] = {}
    self._ready: list[list[int]] = []
    self._counts = dict.fromkeys(_COUNTERS, 0)
    self._read = 0

  def __next__(self) -> dict[str, Any]:
    n = self._ds.batch_size
    while len(self._ready) < n:
      try:
        element = next(self._parent)
      except StopIteration:
        self._ready += self._pool.drain()
        if not self._ready:
          raise
        break
      self._take(self._read, element)
      self._read += 1
    rows, self._ready = self._ready[:n], self._ready[n:]
    return self._batch(rows + [[]] * (n - len(rows)))

  def metrics(self) -> dict[str, float]:
    """Counts so far: records read, skipped, truncated, dropped, packed; packing efficiency."""
    out = dict(self._counts)
    out["packing_efficiency"] = out["tokens"] / out["slots"] if out["slots"] else 0.0
    return out

  def get_state(self) -> dict[str, Any]:
    return {"parent": self._parent.get_state(), "read": self._read, "pool": self._pool.get_state(),
            "ready": [list(r) for r in self._ready], "counts": dict(self._counts)}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._read = state["read"]
    self._pool.set_state(state["pool"])
    self._ready = [list(r) for r in state["ready"]]
    self._counts = dict(state["counts"])
    # Sequences waiting in open rows are re-read by key: element k of the
    # MapDataset is a pure function of k.
    keys = self._pool.keys() + [k for row in self._ready for k in row]
    self._examples = {k: self._ds.examples[k]["example"] for k in keys}

  def _take(self, key: int, element: dict[str, Any]) -> None:
    self._counts["records"] += 1
    status = element["status"]
    if status in ("skipped", "dropped"):
      self._counts[status] += 1
      return
    if status == "truncated":
      self._counts["truncated"] += 1
    self._examples[key] = element["example"]
    if not self._ds.cfg.pack:
      self._ready.append([key])
      return
    closed = self._pool.add(key, _length(element["example"]))
    if closed is not None:
      self._ready.append(closed)

  def _batch(self, rows: list[list[int]]) -> dict[str, Any]:
    examples = [[self._examples.pop(k) for k in row] for row in rows]
    cfg = self._ds.cfg
    self._counts["sequences"] += sum(map(len, examples))
    self._counts["slots"] += len(rows) * cfg.seq_len
    self._counts["tokens"] += sum(_length(ex) for row in examples for ex in row)
    if cfg.kind == "preference":
      return {k: pack_rows([[ex[k] for ex in row] for row in examples], cfg.seq_len, self._ds.pad_id)
              for k in ("chosen", "rejected")}
    batch: dict[str, Any] = pack_rows(examples, cfg.seq_len, self._ds.pad_id)
    if cfg.kind == "rl":
      # Host-side task fields for the reward; an empty (filler) row has None.
      batch["task"] = [row[0]["task"] if row else None for row in examples]
    return batch


def _prepare(raw: RawRecord, *, tokenizer: Tokenizer, cfg: PipelineConfig,
             template: ChatTemplate | None) -> dict[str, Any]:
  """Decode, validate, tokenize and fit one record; runs in reader threads."""
  try:
    example = encode(cfg.kind, tokenizer, decode(raw), raw.where, template, cfg.task_fields)
  except RecordError as e:
    if cfg.on_error == "raise":
      raise
    logging.warning("ptx.data: skipping bad record %s", e)
    return {"status": "skipped", "example": None}
  if _length(example) <= cfg.seq_len:
    return {"status": "ok", "example": example}
  if cfg.overlong == "drop" or cfg.kind == "rl":
    return {"status": "dropped", "example": None}
  streams = [example[k] for k in ("chosen", "rejected")] if cfg.kind == "preference" else [example]
  for s in streams:
    s["tokens"], s["loss_mask"] = s["tokens"][: cfg.seq_len], s["loss_mask"][: cfg.seq_len]
  if not all(s["loss_mask"].any() for s in streams):
    return {"status": "dropped", "example": None}
  return {"status": "truncated", "example": example}


def _length(example: dict[str, Any]) -> int:
  if "chosen" in example:
    return max(len(example["chosen"]["tokens"]), len(example["rejected"]["tokens"]))
  return len(example["tokens"])
