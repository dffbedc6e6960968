"""Random-access record sources: JSONL, ArrayRecord and in-memory.

Each source has `__len__` and `__getitem__`, so grain's `MapDataset.source`
can shuffle and shard it, and returns `RawRecord`s: the undecoded payload plus
where it came from (`file:line`), so a bad record is reported by location.
Decoding and validation happen later, in one place (`ptx.data.records`),
under the pipeline's error policy. A JSONL source without a single record
is a `NoDataError` at construction, naming its files. JSONL files are
local or on object storage (`gs://`, `ptx.paths`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Iterable, Sequence

import numpy as np

from ptx import paths as paths_lib

_CHUNK = 1 << 24
# Whitespace bytes of JSON (RFC 8259) and the vertical tab and form feed: a line of only these is blank.
_BLANK = np.zeros(256, bool)
_BLANK[list(b" \t\r\n\v\f")] = True


class NoDataError(ValueError):
  """Data that gives nothing to train on: files without records, or records of which a pipeline keeps none."""


@dataclasses.dataclass(frozen=True)
class RawRecord:
  """One undecoded record: JSON bytes (files) or a dict (memory), and its location."""

  payload: bytes | dict
  where: str


class JsonlSource:
  """JSON lines files, read by a byte-offset index built once at construction.

  Blank lines (empty or whitespace only, such as a CRLF file's "\\r") are
  not records; line numbers in errors count them anyway, so they match an
  editor's.

  Local files are read with `pread` on one shared descriptor; a file on
  object storage with one ranged read per record through its fsspec
  filesystem (gcsfs, as `ptx.paths` requires): positionless like `pread`,
  so reader threads overlap their requests, and a shuffled order reads no
  more than the records it asks for.

  Args:
    paths: one path or several (read in order, as one sequence), local or gs://.

  Raises:
    NoDataError: when the files hold no record at all.
    ptx.paths.PathError: a path ptx cannot read (an unsupported scheme).
  """

  def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]):
    single = isinstance(paths, (str, os.PathLike))
    self.paths = [str(paths_lib.path(p)) for p in ([paths] if single else paths)]
    starts, ends, lines, files = [], [], [], []
    for f, path in enumerate(self.paths):
      s, e, n = _index_lines(path)
      starts.append(s), ends.append(e), lines.append(n), files.append(np.full(len(s), f, np.int32))
    self._starts = np.concatenate(starts)
    self._ends = np.concatenate(ends)
    self._lines = np.concatenate(lines)
    self._files = np.concatenate(files)
    self._fds: dict[int, int] = {}
    self._remote: dict[int, tuple[Any, str]] = {}  # file -> (fsspec filesystem, its name there)
    self._local = [paths_lib.is_local(p) for p in self.paths]
    if not len(self._starts):
      raise NoDataError(f"{', '.join(self.paths)}: no records (only empty or blank lines)")

  def __len__(self) -> int:
    return len(self._starts)

  def __getitem__(self, index: int) -> RawRecord:
    f = int(self._files[index])
    start = int(self._starts[index])
    length = int(self._ends[index]) - start
    data = self._pread(f, length, start) if self._local[f] else self._read_remote(f, length, start)
    return RawRecord(data, f"{self.paths[f]}:{int(self._lines[index])}")

  def _pread(self, f: int, length: int, start: int) -> bytes:
    fd = self._fds.get(f)
    if fd is None:
      fd = os.open(self.paths[f], os.O_RDONLY)
      kept = self._fds.setdefault(f, fd)
      if kept != fd:  # another reader thread opened it first
        os.close(fd)
        fd = kept
    # pread is positionless, so reader threads share one descriptor safely.
    return os.pread(fd, length, start)

  def _read_remote(self, f: int, length: int, start: int) -> bytes:
    if f not in self._remote:
      import fsspec

      self._remote.setdefault(f, fsspec.core.url_to_fs(self.paths[f]))
    filesystem, name = self._remote[f]
    return filesystem.cat_file(name, start, start + length)

  def __getstate__(self) -> dict[str, Any]:
    # Descriptors do not cross process boundaries; each worker reopens (and finds its own filesystems).
    return {**self.__dict__, "_fds": {}, "_remote": {}}

  def __del__(self):
    for fd in getattr(self, "_fds", {}).values():
      os.close(fd)


def _index_lines(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Start offsets, end offsets and 1-based line numbers of the non-blank lines."""
  newlines, filled = [], []
  offset, carry = 0, False  # carry: the line running into this chunk has a non-blank byte
  with paths_lib.path(path).open("rb") as f:
    while chunk := f.read(_CHUNK):
      data = np.frombuffer(chunk, np.uint8)
      local = np.flatnonzero(data == ord("\n"))
      # Whether each stretch [0, n0), [n0, n1), ..., [nk, end) holds a non-blank byte; a newline is blank.
      stretches = np.logical_or.reduceat(~_BLANK[data], np.concatenate([[0], local]))
      if len(local):
        filled.append(np.concatenate([[stretches[0] | carry], stretches[1:-1]]))
        carry = bool(stretches[-1])
      else:
        carry |= bool(stretches[0])
      newlines.append(local + offset)
      offset += len(chunk)
  ends = np.concatenate(newlines + [np.asarray([offset], np.int64)]).astype(np.int64)
  starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
  numbers = np.arange(1, len(starts) + 1, dtype=np.int64)
  keep = np.concatenate(filled + [np.asarray([carry])])
  return starts[keep], ends[keep], numbers[keep]


class ArrayRecordSource:
  """ArrayRecord files whose records are UTF-8 JSON objects.

  Args:
    paths: one path or several.
  """

  def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]):
    import grain

    single = isinstance(paths, (str, os.PathLike))
    self.paths = [str(p) for p in ([paths] if single else paths)]
    self._source = grain.sources.ArrayRecordDataSource(self.paths)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> RawRecord:
    return RawRecord(self._source[index], f"{','.join(self.paths)}[{index}]")


def write_array_record(path: str | os.PathLike, records: Iterable[dict]) -> int:
  """Writes records as JSON into an ArrayRecord file; returns how many.

  `group_size:1` keeps random access to one record cheap (no group decode).
  """
  from array_record.python.array_record_module import ArrayRecordWriter

  writer = ArrayRecordWriter(str(pathlib.Path(path)), "group_size:1")
  n = 0
  try:
    for record in records:
      writer.write(json.dumps(record, ensure_ascii=False).encode("utf-8"))
      n += 1
  finally:
    writer.close()
  return n


class MemorySource:
  """A list of record dicts held in memory.

  Args:
    records: the records; not copied.
    name: how errors name this source.
  """

  def __init__(self, records: Sequence[dict], name: str = "memory"):
    self.records = records
    self.name = name

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index: int) -> RawRecord:
    return RawRecord(self.records[index], f"{self.name}[{index}]")
