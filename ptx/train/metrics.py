"""Where logged metrics go: `metrics.jsonl`, TensorBoard events and the console.

One JSON object per logged step in `OUT/metrics.jsonl`, each appended with
one `write` to a file opened for appending, so a process killed mid-line
leaves at most a torn last line. On resume, lines for steps after the
restored checkpoint are dropped first, so the file reads as one
uninterrupted run; a torn last line is dropped there too, with a message,
and the kept lines replace the file atomically. A damaged line anywhere
else stops the run with its file and line number.

On object storage, which cannot append, the lines so far replace the whole
object in one upload (atomic: a reader never sees a torn line), at most
every `UPLOAD_EVERY_S` seconds, at every checkpoint (`flush`) and at
`close`, so the training loop does not wait on a growing upload at every
logged step. The loop flushes (locally: fsync) before it starts a
checkpoint's save, so a resumed run finds every line through its
checkpoint's step, wherever the run was killed.
"""

from __future__ import annotations

import json
import os
import time

import tensorboardX
import tqdm

from ptx import paths


# On object storage: the longest a written record waits before metrics.jsonl is uploaded again.
UPLOAD_EVERY_S = 30.0


class MetricsFileError(ValueError):
  """A line of metrics.jsonl that is not a JSON record, before its last line."""


class MetricsWriter:
  """Writes each logged record to JSON lines, TensorBoard and the console.

  Args:
    out: the run directory.
    resume_step: keep existing records up to this step (None: start afresh).
    enabled: False on the non-primary processes of a multi-host job, which write nothing.
  """

  def __init__(self, out: str | os.PathLike, *, resume_step: int | None = None, enabled: bool = True):
    self.enabled = enabled
    out = paths.path(out)
    self.path = out / "metrics.jsonl"
    if not enabled:
      return
    kept = kept_records(self.path, resume_step) if resume_step is not None else []
    paths.write_atomic(self.path, "".join(line + "\n" for line in kept))
    # Locally an appending descriptor; on object storage the lines so far, uploaded whole (`flush`).
    local = paths.is_local(out)
    self._fd, self._lines = (os.open(self.path, os.O_WRONLY | os.O_APPEND), None) if local else (None, kept)
    self._uploaded_at, self._pending = time.monotonic(), False
    self._tensorboard = tensorboardX.SummaryWriter(str(out / "tensorboard"))

  def write(self, record: dict[str, float]) -> None:
    """Appends one record; `record["step"]` is the x-axis."""
    if not self.enabled:
      return
    line = json.dumps(record)
    if self._fd is not None:
      os.write(self._fd, (line + "\n").encode())  # one write: a line is whole or torn at the end
    else:
      self._lines.append(line)
      self._pending = True
      if time.monotonic() - self._uploaded_at >= UPLOAD_EVERY_S:
        self.flush()
    step = int(record["step"])
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)):
        self._tensorboard.add_scalar(key, value, step)
    line = " ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
    tqdm.tqdm.write(line)  # above the progress bar when there is one

  def close(self) -> None:
    """Flushes and closes the files."""
    if not self.enabled:
      return
    self.flush()
    if self._fd is not None:
      os.close(self._fd)
    self._tensorboard.close()

  def flush(self) -> None:
    """Makes the lines written so far durable: locally synced to disk, on object storage uploaded."""
    if not self.enabled:
      return
    if self._fd is not None:
      os.fsync(self._fd)  # each line is written at once; this outlasts a crash of the machine too
    if not self._pending:
      return
    paths.write_atomic(self.path, "".join(line + "\n" for line in self._lines))
    self._uploaded_at, self._pending = time.monotonic(), False


def kept_records(path: str | os.PathLike, up_to_step: int) -> list[str]:
  """The lines of `path` whose step is at most `up_to_step`; a torn last line is dropped with a message.

  Raises:
    MetricsFileError: a line before the last is not a JSON record with a step.
  """
  path = paths.path(path)
  if not path.exists():
    return []
  lines = path.read_bytes().decode(errors="replace").splitlines()
  kept = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      step = json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      if number == len(lines):
        print(f"repaired {path}: dropped its torn last line {number} ({len(line)} bytes; the run was killed "
              "mid-write)", flush=True)
        continue
      raise MetricsFileError(f"{path}:{number}: not a metrics record ({e}); fix or remove the line to resume") \
          from e
    if step <= up_to_step:
      kept.append(line)
  return kept
