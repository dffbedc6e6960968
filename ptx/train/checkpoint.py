"""Checkpoints with Orbax: state and data-iterator position, async, keep-last-n.

A checkpoint is a step directory holding the TrainState (`state`), the
grain iterator's state (`data`) and, when the step function keeps work in
flight across steps (GRPO's host-reward pipeline), that work as host arrays
(`pipeline`). Orbax writes in the background and
publishes a step only once complete, so a process killed mid-write leaves
the previous steps intact. If the newest step cannot be restored (damaged
files), restore falls back to the one before, with a warning, and moves the
damaged step aside (`<directory>.damaged/`) rather than deleting it.
"""

from __future__ import annotations

import logging
import pathlib
import shutil
from typing import Any

import grain
import orbax.checkpoint as ocp

from ptx.train.state import TrainState

log = logging.getLogger(__name__)


class Checkpointer:
  """Saves and restores (TrainState, data iterator) pairs under one directory.

  Args:
    directory: where step directories live.
    keep: how many of the newest checkpoints to keep.
  """

  def __init__(self, directory: str | pathlib.Path, keep: int):
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
    self._directory = pathlib.Path(directory).absolute()
    self._manager = ocp.CheckpointManager(self._directory, options=options,
                                          item_names=("state", "data", "pipeline"))

  def steps(self) -> list[int]:
    """The steps of complete checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: TrainState, data_iterator: Any, pipeline: Any = None) -> None:
    """Starts saving; device buffers are copied before this returns, so `state` may be donated next.

    `pipeline` is an optional pytree of host (numpy) arrays saved beside the
    state: the step function's work in flight.
    """
    items = {"state": ocp.args.StandardSave(state), "data": grain.checkpoint.CheckpointSave(data_iterator)}
    if pipeline is not None:
      items["pipeline"] = ocp.args.StandardSave(pipeline)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, abstract_state: TrainState, data_iterator: Any) -> tuple[int, TrainState, Any] | None:
    """Restores the newest restorable checkpoint into `data_iterator`; None when there is none.

    Args:
      abstract_state: ShapeDtypeStructs with the target shardings (any mesh).
      data_iterator: a fresh iterator of the same pipeline; its state is set.

    Returns:
      (step, state, pipeline), or None when no checkpoint exists; `pipeline`
      is the saved host arrays, or None when the step saved none.

    Raises:
      RuntimeError: when checkpoints exist but none can be restored.
    """
    errors = []
    for step in reversed(self.steps()):
      try:
        items = {"state": ocp.args.StandardRestore(abstract_state),
                 "data": grain.checkpoint.CheckpointRestore(data_iterator)}
        if (self._directory / str(step) / "pipeline").exists():
          items["pipeline"] = ocp.args.StandardRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
      except Exception as e:  # a damaged step: any reader error; try the previous one
        log.warning("checkpoint step %d cannot be restored (%s: %s); trying the previous one",
                    step, type(e).__name__, e)
        errors.append(f"step {step}: {type(e).__name__}: {e}")
        continue
      self._set_aside(damaged=[s for s in self.steps() if s > step])
      return step, restored["state"], restored.get("pipeline")
    if errors:
      raise RuntimeError("no checkpoint could be restored:\n" + "\n".join(errors))
    return None

  def _set_aside(self, damaged: list[int]) -> None:
    """Moves unrestorable steps to `<directory>.damaged/` so the run can write those steps again."""
    for step in damaged:
      target = self._directory.with_name(self._directory.name + ".damaged") / str(step)
      target.parent.mkdir(exist_ok=True)
      shutil.move(str(self._directory / str(step)), str(target))
      log.warning("moved the damaged checkpoint of step %d to %s", step, target)
    if damaged:
      self._manager.reload()

  def wait(self) -> None:
    """Blocks until background saves are written."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.close()
