"""From a stream of prepared examples to host batches, with checkpointable state.

The `Batcher` receives elements in stream order, each under its stream index
(its key) and already fitted to the row length (`fit`). It packs them
first-fit (`ptx.data.packing.BinPool`) or gives each its own row, and hands
out [B, T] batches (`ptx.data.batch.pack_rows`). Its state is the keys of the
examples it holds and its counters, all JSON; whoever restores it re-reads
those examples by key. Both the grain pipeline and the seqio adapter batch
through it, so they produce identical layouts.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ptx.data.batch import pack_rows
from ptx.data.packing import BinPool

COUNTERS = ("records", "skipped", "truncated", "dropped", "sequences", "tokens", "slots")


def length(example: dict[str, Any]) -> int:
  """Tokens of an example (a preference pair: its longer reply)."""
  if "chosen" in example:
    return max(len(example["chosen"]["tokens"]), len(example["rejected"]["tokens"]))
  return len(example["tokens"])


def fit(example: dict[str, Any], kind: str, seq_len: int, overlong: str) -> dict[str, Any]:
  """Applies the overlong policy; returns the element `{"status", "example"}`.

  Status is "ok", "truncated" (the first `seq_len` tokens kept) or "dropped"
  (policy "drop"; or nothing left to train on after truncation; or an RL
  prompt, which truncation would cut off before its question ends).
  """
  if length(example) <= seq_len:
    return {"status": "ok", "example": example}
  if overlong == "drop" or kind == "rl":
    return {"status": "dropped", "example": None}
  streams = [example[k] for k in ("chosen", "rejected")] if kind == "preference" else [example]
  for s in streams:
    s["tokens"], s["loss_mask"] = s["tokens"][:seq_len], s["loss_mask"][:seq_len]
  if not all(s["loss_mask"].any() for s in streams):
    return {"status": "dropped", "example": None}
  return {"status": "truncated", "example": example}


class Batcher:
  """Packs or pads keyed examples into batches of `batch_size` rows.

  Args:
    kind: record kind ("sft", "preference" or "rl").
    seq_len: T.
    batch_size: rows per batch (this host's share).
    pad_id: token id of padding.
    pack: first-fit packing; else one example per row.
    num_bins: open rows of the packer.
  """

  def __init__(self, kind: str, seq_len: int, batch_size: int, pad_id: int, pack: bool, num_bins: int):
    self.kind, self.seq_len, self.batch_size, self.pad_id, self.pack = kind, seq_len, batch_size, pad_id, pack
    self._pool = BinPool(seq_len, num_bins)
    self._examples: dict[int, dict[str, Any]] = {}
    self._ready: list[list[int]] = []
    self._counts = dict.fromkeys(COUNTERS, 0)

  def take(self, key: int, element: dict[str, Any]) -> None:
    """Adds the element with stream index `key` (a status from `fit`, or "skipped")."""
    self._counts["records"] += 1
    status = element["status"]
    if status != "ok":
      self._counts[status] += 1
    if status in ("skipped", "dropped"):
      return
    self._examples[key] = element["example"]
    if not self.pack:
      self._ready.append([key])
    elif (closed := self._pool.add(key, length(element["example"]))) is not None:
      self._ready.append(closed)

  def full(self) -> bool:
    """Whether a whole batch of rows is ready."""
    return len(self._ready) >= self.batch_size

  def finish(self) -> bool:
    """At the end of the stream, closes every open row; whether any row is left."""
    self._ready += self._pool.drain()
    return bool(self._ready)

  def batch(self) -> dict[str, Any]:
    """The next batch; at the end of the stream, short batches get empty rows."""
    n = self.batch_size
    keys, self._ready = self._ready[:n], self._ready[n:]
    rows = [[self._examples.pop(k) for k in row] for row in keys] + [[]] * (n - len(keys))
    self._counts["sequences"] += sum(map(len, rows))
    self._counts["slots"] += n * self.seq_len
    self._counts["tokens"] += sum(length(ex) for row in rows for ex in row)
    if self.kind == "preference":
      batch = {k: pack_rows([[ex[k] for ex in row] for row in rows], self.seq_len, self.pad_id)
               for k in ("chosen", "rejected")}
      # Source index of each pair (-1: an empty filler row, or a source without indices).
      batch["record_index"] = np.asarray([row[0].get("record_index", -1) if row else -1 for row in rows], np.int32)
      return batch
    batch: dict[str, Any] = pack_rows(rows, self.seq_len, self.pad_id)
    if self.kind == "rl":
      # Host-side task fields for the reward; an empty (filler) row has None.
      batch["task"] = [row[0]["task"] if row else None for row in rows]
    return batch

  def metrics(self) -> dict[str, float]:
    """Counts so far: records read, skipped, truncated, dropped, packed; packing efficiency."""
    out: dict[str, float] = dict(self._counts)
    out["packing_efficiency"] = out["tokens"] / out["slots"] if out["slots"] else 0.0
    return out

  def get_state(self) -> dict[str, Any]:
    """Open rows, ready rows and counters, as JSON-able values."""
    return {"pool": self._pool.get_state(), "ready": [list(r) for r in self._ready],
            "counts": dict(self._counts)}

  def set_state(self, state: dict[str, Any], read: Callable[[list[int]], dict[int, dict[str, Any]]]) -> None:
    """Restores `get_state`'s output; `read(keys)` returns those examples again."""
    self._pool.set_state(state["pool"])
    self._ready = [list(r) for r in state["ready"]]
    self._counts = dict(state["counts"])
    self._examples = read(self._pool.keys() + [k for row in self._ready for k in row])
