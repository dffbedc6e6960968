"""The grain pipeline from a record source to host-local [B, T] batches.

    source -> seeded shuffle (a new order each epoch) -> repeat
      -> this host's shard (every process_count-th element, from process_index)
      -> decode + validate + tokenize + fit to T   (grain threads)
      -> first-fit packing (or one sequence per row) -> [B / process_count, T]

With images (`images=`, `data.tiles_per_row` > 0), records' image parts are
tiled in the reader threads, a row packs at most `tiles_per_row` tiles
beside its T tokens, and every batch carries the image arrays of
`ptx.data.batch` (a record with more tiles than a row is dropped, counted).

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

Accounting: `metrics()` counts records "read", "skipped", "truncated" and
"dropped", and the "sequences", "tokens", "slots" and "packing_efficiency"
of the batches so far (`ptx.data.batcher`); `skip_reasons()` gives the first
few skipped or dropped records as "file:line: why". These names are the
`data/...` metrics a training run logs.

A stream that can never yield a batch stops with a `NoDataError` from
`next()`, naming the first records it did not keep, why, and the shortest
and longest data.seq_len they need: as soon as every record this host can
read (all of them when shuffled or on one host; else its fixed share) was
read since the last kept example and none was kept, or when a finite stream
ends without a kept example.
"""

from __future__ import annotations

import array
import functools
import logging
import math
from typing import Any, Sequence

import grain
import numpy as np

from ptx.config import DataConfig
from ptx.data.batcher import Batcher, fit
from ptx.data.chat import ChatTemplate
from ptx.data.images import ImageConfig
from ptx.data.records import RecordError, decode, encode
from ptx.data.sources import RawRecord
from ptx.data.tokenizer import Tokenizer


def make_pipeline(source: Sequence[RawRecord], tokenizer: Tokenizer, cfg: DataConfig, *,
                  template: ChatTemplate | None = None, images: ImageConfig | None = None, process_index: int = 0,
                  process_count: int = 1) -> "BatchDataset":
  """Builds this host's pipeline.

  Args:
    source: a random-access source (`ptx.data.sources`).
    tokenizer: any `Tokenizer`.
    cfg: the pipeline configuration.
    template: chat template for `messages` records (default: the
      tokenizer's, else ChatML).
    images: how records' images become tiles and tokens
      (`ptx.data.images.image_config` of the model); None, with
      `cfg.tiles_per_row` 0, for text only.
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
  if (images is None) != (cfg.tiles_per_row == 0):
    raise ValueError(f"data.tiles_per_row={cfg.tiles_per_row} and images={images}: a pipeline with images needs "
                     "both (ptx.data.images.image_config), a text-only one neither")
  # Each record keeps its source index (a preference pair's `record_index`, the key of precomputed references).
  # Grain passes the index of the outermost access through repeat(), hence the modulo.
  ds = grain.MapDataset.source(source).map_with_index(lambda index, raw: (index % len(source), raw))
  if cfg.shuffle:
    ds = ds.seed(cfg.seed).shuffle()
  ds = ds.repeat(cfg.num_epochs)[process_index::process_count]
  prepare = functools.partial(_prepare, tokenizer=tokenizer, cfg=cfg, template=template, images=images)
  # Shuffled epochs deal every record to every host in time; in source order a host reads one residue class.
  readable = len(source) if cfg.shuffle else len(source) // math.gcd(len(source), process_count)
  return BatchDataset(ds.map(prepare), cfg, tokenizer.pad_id, cfg.batch_size // process_count,
                      len(source), readable, 0 if images is None else images.tile_size)


class BatchDataset(grain.IterDataset):
  """Packs or pads a MapDataset of prepared examples into host batches.

  Args:
    examples: the prepared elements of this host, in stream order.
    cfg: the pipeline configuration.
    pad_id: token id of padding.
    batch_size: rows per host batch.
    num_records: records in the source.
    readable: distinct records this host's stream ever reads.
    tile_size: side of an image tile in pixels (0: text only).
  """

  def __init__(self, examples: grain.MapDataset, cfg: DataConfig, pad_id: int, batch_size: int, num_records: int,
               readable: int, tile_size: int = 0):
    super().__init__()
    self.examples = examples
    self.cfg = cfg
    self.pad_id = pad_id
    self.batch_size = batch_size
    self.num_records = num_records
    self.readable = readable
    self.tile_size = tile_size

  def __iter__(self) -> "BatchIterator":
    return BatchIterator(self)


class BatchIterator(grain.DatasetIterator):
  """Yields host batches; its state resumes the stream exactly."""

  def __init__(self, ds: BatchDataset):
    options = grain.ReadOptions(num_threads=ds.cfg.num_threads, prefetch_buffer_size=ds.cfg.prefetch)
    super().__init__(iter(ds.examples.to_iter_dataset(options)))
    self._ds = ds
    cfg = ds.cfg
    self._batcher = Batcher(cfg.kind, cfg.seq_len, ds.batch_size, ds.pad_id, cfg.pack, cfg.num_bins,
                            cfg.tiles_per_row, ds.tile_size)
    self._read = 0
    self._unkept = _UnkeptRecords(ds.num_records)

  def __next__(self) -> dict[str, Any]:
    while not self._batcher.full():
      try:
        element = next(self._parent)
      except StopIteration:
        if not self._batcher.finish():
          raise
        break
      kept = self._batcher.take(self._read, element)
      self._read += 1
      if self._unkept.add(None if kept else element["index"]) == self._ds.readable:
        raise self._batcher.nothing_kept(f"the {self._ds.readable} records this host reads")
    return self._batcher.batch()

  def metrics(self) -> dict[str, int | float]:
    """Counts so far (see the module docstring), as plain numbers."""
    return self._batcher.metrics()

  def skip_reasons(self) -> list[str]:
    """The first (at most 5) skipped or dropped records, as "file:line: why"."""
    return self._batcher.reasons()

  def get_state(self) -> dict[str, Any]:
    return {"parent": self._parent.get_state(), "read": self._read, **self._batcher.get_state()}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._read = state["read"]
    self._unkept = _UnkeptRecords(self._ds.num_records)  # counts afresh: a resumed stream stops a pass later at most
    # Element k of the MapDataset is a pure function of k, so the examples
    # waiting in open rows are re-read by key.
    self._batcher.set_state(state, lambda keys: {k: self._ds.examples[k]["example"] for k in keys})


def _prepare(indexed: tuple[int, RawRecord], *, tokenizer: Tokenizer, cfg: DataConfig,
             template: ChatTemplate | None, images: ImageConfig | None) -> dict[str, Any]:
  """Decode, validate, tokenize and fit one (source index, record); runs in reader threads."""
  index, raw = indexed
  try:
    example = encode(cfg.kind, tokenizer, decode(raw), raw.where, template, cfg.task_fields, images)
    if cfg.kind == "preference":
      example["record_index"] = index
  except RecordError as e:
    if cfg.on_error == "raise":
      raise
    logging.warning("ptx.data: skipping bad record %s", e)
    return {"status": "skipped", "example": None, "reason": str(e), "index": index}
  return {**fit(example, cfg.kind, cfg.seq_len, cfg.overlong, raw.where, cfg.tiles_per_row), "index": index}


class _UnkeptRecords:
  """How many distinct records were read since the last kept example.

  One flag per record (made once a record goes unkept: a byte per record)
  and the indices of those set, which a kept example clears in time
  proportional to the run it ends.
  """

  def __init__(self, num_records: int):
    self._num_records = num_records
    self._seen: np.ndarray | None = None
    self._set = array.array("q")

  def add(self, index: int | None) -> int:
    """Counts the source index of an unkept record (None: an example was kept); returns the run's count."""
    if index is None:
      if self._set:
        self._seen[np.frombuffer(self._set, np.int64)] = False
        self._set = array.array("q")
    else:
      if self._seen is None:
        self._seen = np.zeros(self._num_records, bool)
      if not self._seen[index]:
        self._seen[index] = True
        self._set.append(index)
    return len(self._set)
