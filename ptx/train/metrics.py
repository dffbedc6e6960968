"""Where logged metrics go: `metrics.jsonl`, TensorBoard events and the console.

One JSON object per logged step in `OUT/metrics.jsonl`. On resume, lines for
steps after the restored checkpoint are dropped first, so the file reads as
one uninterrupted run.
"""

from __future__ import annotations

import json
import pathlib

import tensorboardX
import tqdm


class MetricsWriter:
  """Writes each logged record to JSON lines, TensorBoard and the console.

  Args:
    out: the run directory.
    resume_step: keep existing records up to this step (None: start afresh).
    enabled: False on the non-primary processes of a multi-host job, which write nothing.
  """

  def __init__(self, out: pathlib.Path, *, resume_step: int | None = None, enabled: bool = True):
    self.enabled = enabled
    self.path = out / "metrics.jsonl"
    if not enabled:
      return
    kept = []
    if resume_step is not None and self.path.exists():
      kept = [line for line in self.path.read_text().splitlines()
              if line.strip() and json.loads(line)["step"] <= resume_step]
    self.path.write_text("".join(line + "\n" for line in kept))
    self._file = self.path.open("a")
    self._tensorboard = tensorboardX.SummaryWriter(str(out / "tensorboard"))

  def write(self, record: dict[str, float]) -> None:
    """Appends one record; `record["step"]` is the x-axis."""
    if not self.enabled:
      return
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    step = int(record["step"])
    for key, value in record.items():
      if key != "step":
        self._tensorboard.add_scalar(key, value, step)
    line = " ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
    tqdm.tqdm.write(line)  # above the progress bar when there is one

  def close(self) -> None:
    """Flushes and closes the files."""
    if not self.enabled:
      return
    self._file.close()
    self._tensorboard.close()
