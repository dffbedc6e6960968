"""From a stream of prepared examples to host batches, with checkpointable state.

The `Batcher` receives elements in stream order, each under its stream index
(its key) and already fitted to the row length (`fit`). It packs them
first-fit (`ptx.data.packing.BinPool`) or gives each its own row, and hands
out [B, T] batches (`ptx.data.batch.pack_rows`). Its state is the keys of the
examples it holds, its counters and the first reasons of records it did not
keep, all JSON; whoever restores it re-reads those examples by key. Both the
grain pipeline and the seqio adapter batch through it, so they produce
identical layouts.

Counters (`metrics()`, plain ints): "read" records, of which "skipped" (bad
records under on_error="skip"), "truncated" and "dropped" (overlong); and
"sequences", "tokens" and "slots" of the batches handed out, with their
"packing_efficiency" (a float). `reasons()` are the first `MAX_REASONS`
"where: why" of the skipped and dropped records. A stream that ends without
having kept a single example is a `NoDataError` saying why.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ptx.data.batch import pack_rows
from ptx.data.packing import BinPool
from ptx.data.sources import NoDataError

COUNTERS = ("read", "skipped", "truncated", "dropped", "sequences", "tokens", "slots")
# Reasons kept of records not kept: enough to see the pattern, few enough for a log line.
MAX_REASONS = 5


def length(example: dict[str, Any]) -> int:
  """Tokens of an example (a preference pair: its longer reply)."""
  if "chosen" in example:
    return max(len(example["chosen"]["tokens"]), len(example["rejected"]["tokens"]))
  return len(example["tokens"])


def tiles(example: dict[str, Any]) -> int:
  """Image tiles of an example (0 without images)."""
  return len(example["pixel_values"]) if "pixel_values" in example else 0


def fit(example: dict[str, Any], kind: str, seq_len: int, overlong: str, where: str,
        tiles_per_row: int = 0) -> dict[str, Any]:
  """Applies the overlong policy and the row's tile budget; returns the element `{"status", "example"}`.

  Status is "ok", "truncated" (the first `seq_len` tokens kept) or "dropped"
  (policy "drop"; or nothing left to train on after truncation; or an RL
  prompt, which truncation would cut off before its question ends; or a cut
  through an image's tokens, whose tiles go with all of them; or more image
  tiles than a row's `tiles_per_row`). A dropped element also has "reason"
  ("where: why") and, when dropped for its length, "needed", the seq_len
  that would keep it.
  """
  if tiles(example) > tiles_per_row:
    return {"status": "dropped", "example": None,
            "reason": f"{where}: {tiles(example)} image tiles, more than a row's data.tiles_per_row={tiles_per_row}"}
  n = length(example)
  if n <= seq_len:
    return {"status": "ok", "example": example}
  if kind == "rl":
    return _dropped(where, f"a prompt of {n} tokens, longer than data.seq_len={seq_len} (prompts are never cut)", n)
  if overlong == "drop":
    return _dropped(where, f"{n} tokens, longer than data.seq_len={seq_len} (data.overlong='drop')", n)
  streams = [example[k] for k in ("chosen", "rejected")] if kind == "preference" else [example]
  # Records always have a target (records.encode refuses empty replies), so every stream has a first one.
  needed = max(int(np.flatnonzero(s["loss_mask"])[0]) + 1 for s in streams)
  if needed > seq_len:
    return _dropped(where, f"{n} tokens, the first {needed - 1} before any target: truncation to "
                    f"data.seq_len={seq_len} leaves no target token", needed)
  if "image_slots" in example:
    # An image's tiles go with all of its tokens: a cut keeps its last image token and the marker closing it.
    image_end = int(np.flatnonzero(example["image_slots"] >= 0)[-1]) + 2 if example["pixel_values"].size else 0
    if image_end > seq_len:
      return _dropped(where, f"{n} tokens, the last image's ending at token {image_end}: truncation to "
                      f"data.seq_len={seq_len} would cut the image", image_end)
    example["image_slots"] = example["image_slots"][:seq_len]
  for s in streams:
    s["tokens"], s["loss_mask"] = s["tokens"][:seq_len], s["loss_mask"][:seq_len]
  return {"status": "truncated", "example": example}


def _dropped(where: str, why: str, needed: int) -> dict[str, Any]:
  return {"status": "dropped", "example": None, "reason": f"{where}: {why}", "needed": needed}


class Batcher:
  """Packs or pads keyed examples into batches of `batch_size` rows.

  Args:
    kind: record kind ("sft", "preference" or "rl").
    seq_len: T.
    batch_size: rows per batch (this host's share).
    pad_id: token id of padding.
    pack: first-fit packing; else one example per row.
    num_bins: open rows of the packer.
    tiles_per_row: image tiles of a row (0: text only), as `ptx.data.batch.pack_rows` takes them.
    tile_size: side of a tile in pixels (with `tiles_per_row`).
  """

  def __init__(self, kind: str, seq_len: int, batch_size: int, pad_id: int, pack: bool, num_bins: int,
               tiles_per_row: int = 0, tile_size: int = 0):
    self.kind, self.seq_len, self.batch_size, self.pad_id, self.pack = kind, seq_len, batch_size, pad_id, pack
    self.tiles_per_row, self.tile_size = tiles_per_row, tile_size
    self._pool = BinPool(seq_len, num_bins, tiles_per_row)
    self._examples: dict[int, dict[str, Any]] = {}
    self._ready: list[list[int]] = []
    self._counts = dict.fromkeys(COUNTERS, 0)
    self._reasons: list[str] = []
    self._needed: list[int] = []  # [shortest, longest] seq_len that the dropped records need

  def take(self, key: int, element: dict[str, Any]) -> bool:
    """Adds the element with stream index `key` (from `fit`, or "skipped" with a "reason"); whether it is kept."""
    self._counts["read"] += 1
    status = element["status"]
    if status != "ok":
      self._counts[status] += 1
    if status in ("skipped", "dropped"):
      if len(self._reasons) < MAX_REASONS:
        self._reasons.append(element["reason"])
      if "needed" in element:
        self._needed = [min(self._needed + [element["needed"]]), max(self._needed + [element["needed"]])]
      return False
    self._examples[key] = element["example"]
    if not self.pack:
      self._ready.append([key])
    elif (closed := self._pool.add(key, length(element["example"]), tiles(element["example"]))) is not None:
      self._ready.append(closed)
    return True

  def full(self) -> bool:
    """Whether a whole batch of rows is ready."""
    return len(self._ready) >= self.batch_size

  def finish(self) -> bool:
    """At the end of the stream, closes every open row; whether any row is left.

    Raises:
      NoDataError: when the stream read records and kept none of them.
    """
    c = self._counts
    if c["read"] and c["read"] == c["skipped"] + c["dropped"]:
      raise self.nothing_kept(f"the {c['read']} records of the stream")
    self._ready += self._pool.drain()
    return bool(self._ready)

  def nothing_kept(self, what: str) -> NoDataError:
    """The error for a stream that kept no example of `what` (e.g. "the 3 records of the stream")."""
    c = self._counts
    message = (f"no example to train on: none of {what} was kept ({c['dropped']} dropped, {c['skipped']} skipped "
               f"as bad records); first: {'; '.join(self._reasons)}")
    if self._needed:
      message += f". The shortest record needs data.seq_len >= {self._needed[0]}, the longest {self._needed[1]}"
    return NoDataError(message)

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
    batch: dict[str, Any] = pack_rows(rows, self.seq_len, self.pad_id, self.tiles_per_row, self.tile_size)
    if self.kind == "rl":
      # Host-side task fields for the reward; an empty (filler) row has None.
      batch["task"] = [row[0]["task"] if row else None for row in rows]
    return batch

  def metrics(self) -> dict[str, int | float]:
    """The counters of the module docstring, as plain numbers."""
    out: dict[str, int | float] = {k: int(v) for k, v in self._counts.items()}
    out["packing_efficiency"] = out["tokens"] / out["slots"] if out["slots"] else 0.0
    return out

  def reasons(self) -> list[str]:
    """The first `MAX_REASONS` skipped or dropped records, as "where: why"."""
    return list(self._reasons)

  def get_state(self) -> dict[str, Any]:
    """Open rows, ready rows, counters and reasons, as JSON-able values."""
    return {"pool": self._pool.get_state(), "ready": [list(r) for r in self._ready],
            "counts": dict(self._counts), "reasons": list(self._reasons), "needed": list(self._needed)}

  def set_state(self, state: dict[str, Any], read: Callable[[list[int]], dict[int, dict[str, Any]]]) -> None:
    """Restores `get_state`'s output; `read(keys)` returns those examples again."""
    self._pool.set_state(state["pool"])
    self._ready = [list(r) for r in state["ready"]]
    counts = dict(state["counts"])
    if "records" in counts:  # a checkpoint from before the counter was named "read"
      counts["read"] = counts.pop("records")
    self._counts = counts
    # Checkpoints from before reasons were kept have none.
    self._reasons, self._needed = list(state.get("reasons", [])), list(state.get("needed", []))
    self._examples = read(self._pool.keys() + [k for row in self._ready for k in row])
