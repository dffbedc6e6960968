"""seqio Tasks and Mixtures as ptx batches (the `ptx[seqio]` extra).

seqio does the reading, preprocessing and tokenizing (with the task's own
vocabulary); ptx does the rest exactly as for its own pipelines: each
example becomes `[bos] + inputs + targets` with the loss mask on `targets`
(seqio's decoders feed id 0 as the first input, so bos defaults to 0), the
overlong policy applies, and the shared `Batcher` packs first-fit into the
ptx batch schema. seqio and TensorFlow are imported only when the adapter is
used; nothing in the ptx core imports this module.

Resume: seqio streams cannot be indexed, so the state holds the number of
examples read (with a fixed seed the stream is the same every time) and the
keys of the examples held by the packer; restoring re-reads the stream up to
that point, O(examples read), as seqio's own `skip(n)` would.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping

import grain
import numpy as np

from ptx.data.batcher import Batcher, fit
from ptx.config import DataConfig
from ptx.data.records import RecordError


def _seqio():
  try:
    import seqio
  except ImportError as e:
    raise ImportError("the seqio adapter needs seqio: pip install 'ptx[seqio]'") from e
  return seqio


class SeqioBatches:
  """Iterable of ptx batches from a seqio Task or Mixture.

  Args:
    task: a registered Task/Mixture name, or the object.
    cfg: the pipeline configuration (kind "sft"; `task_fields`, `num_threads`
      and `prefetch` do not apply).
    split: the split to read.
    feature_lengths: seqio `sequence_length`; defaults to `cfg.seq_len` for
      each of the task's `inputs`/`targets` features.
    bos_id: the id put before each sequence.
    process_index: this host.
    process_count: hosts; each reads its own seqio shard.
  """

  def __init__(self, task: Any, cfg: DataConfig, *, split: str = "train",
               feature_lengths: Mapping[str, int] | None = None, bos_id: int = 0,
               process_index: int = 0, process_count: int = 1):
    seqio = _seqio()
    if cfg.kind != "sft":
      raise ValueError(f"the seqio adapter makes sft batches, got kind={cfg.kind!r}")
    if cfg.batch_size % process_count:
      raise ValueError(f"batch_size {cfg.batch_size} does not split over {process_count} processes")
    self.task = seqio.get_mixture_or_task(task) if isinstance(task, str) else task
    self.cfg = cfg
    self.split = split
    features = [k for k in ("inputs", "targets") if k in self.task.output_features]
    self.feature_lengths = dict(feature_lengths or {k: cfg.seq_len for k in features})
    self.bos_id = bos_id
    self.pad_id = self.task.output_features["targets"].vocabulary.pad_id
    self.shard = seqio.ShardInfo(index=process_index, num_shards=process_count)
    self.batch_size = cfg.batch_size // process_count

  def __iter__(self) -> "SeqioIterator":
    return SeqioIterator(self)

  def stream(self) -> Iterator[dict[str, np.ndarray]]:
    """This host's examples in order: the same sequence on every call."""
    ds = self.task.get_dataset(
        sequence_length=self.feature_lengths, split=self.split, shuffle=self.cfg.shuffle,
        seed=self.cfg.seed, shard_info=self.shard, num_epochs=self.cfg.num_epochs)
    return ds.as_numpy_iterator()

  def element(self, key: int, example: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """A seqio example as a fitted ptx element (or a skipped one)."""
    inputs = np.asarray(example.get("inputs", []), np.int32)
    targets = np.asarray(example["targets"], np.int32)
    where = f"{self.task.name}[{key}]"
    if not targets.size:
      error = RecordError(where, "empty targets")
      if self.cfg.on_error == "raise":
        raise error
      logging.warning("ptx.data: skipping bad record %s", error)
      return {"status": "skipped", "example": None, "reason": str(error)}
    tokens = np.concatenate([np.asarray([self.bos_id], np.int32), inputs, targets])
    mask = np.concatenate([np.zeros(1 + inputs.size, np.int32), np.ones(targets.size, np.int32)])
    return fit({"tokens": tokens, "loss_mask": mask}, "sft", self.cfg.seq_len, self.cfg.overlong, where)


class SeqioIterator(grain.DatasetIterator):
  """Yields host batches from seqio; `get_state`/`set_state` resume exactly."""

  def __init__(self, ds: SeqioBatches):
    super().__init__()
    self._ds = ds
    cfg = ds.cfg
    self._batcher = Batcher("sft", cfg.seq_len, ds.batch_size, ds.pad_id, cfg.pack, cfg.num_bins)
    self._stream = ds.stream()
    self._read = 0

  def __next__(self) -> dict[str, Any]:
    while not self._batcher.full():
      try:
        example = next(self._stream)
      except StopIteration:
        if not self._batcher.finish():
          raise
        break
      self._batcher.take(self._read, self._ds.element(self._read, example))
      self._read += 1
    return self._batcher.batch()

  def metrics(self) -> dict[str, int | float]:
    """Counts so far, as `ptx.data.pipeline.BatchIterator.metrics`."""
    return self._batcher.metrics()

  def skip_reasons(self) -> list[str]:
    """The first skipped or dropped examples, as `ptx.data.pipeline.BatchIterator.skip_reasons`."""
    return self._batcher.reasons()

  def get_state(self) -> dict[str, Any]:
    return {"read": self._read, **self._batcher.get_state()}

  def set_state(self, state: dict[str, Any]) -> None:
    self._read = state["read"]
    self._stream = self._ds.stream()
    self._batcher.set_state(state, self._replay)

  def _replay(self, keys: list[int]) -> dict[int, dict[str, Any]]:
    """Re-reads the stream up to the saved position, keeping the held examples."""
    wanted, out = set(keys), {}
    for key in range(self._read):
      example = next(self._stream)
      if key in wanted:
        out[key] = self._ds.element(key, example)["example"]
    return out
