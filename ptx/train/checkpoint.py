"""Checkpoints with Orbax: state and data-iterator position, async, keep-last-n, verified on restore.

A checkpoint is a step directory holding the TrainState (`state`), the
grain iterator's state (`data`), when the step function keeps work in
flight across steps (GRPO's host-reward pipeline) that work as host arrays
(`pipeline`), and the checksums of all three (`checksums`,
`ptx.train.checksums`). Orbax writes in the background and publishes a step
only once complete, so a process killed mid-write leaves the previous steps
intact.

Restore verifies every array, the data position and the pipeline against
the checksums. A damaged step (checksums that differ or are missing, files
missing, truncated or undecodable) is moved aside (`<directory>.damaged/`,
never deleted) and the step before is tried, with a warning that names the
step and the damage. Any other error (a state that does not fit the checkpoint,
permission denied, a transient I/O failure) is not damage: it propagates
and nothing is moved.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterator

import grain
import jax
import orbax.checkpoint as ocp

from ptx import paths
from ptx.train import checksums
from ptx.train.state import TrainState

log = logging.getLogger(__name__)

# Reader errors that mean the files are damaged; tensorstore reports them as status codes in the message.
_DAMAGE_TYPES = (json.JSONDecodeError, UnicodeDecodeError, FileNotFoundError, EOFError)
_DAMAGE_MARKERS = ("DATA_LOSS", "FAILED_PRECONDITION", "NOT_FOUND", "OUT_OF_RANGE", "Truncated", "Error decoding",
                   "corrupt")


class CheckpointError(RuntimeError):
  """No checkpoint in the directory can be restored; the message lists each step's damage."""


class DamagedCheckpoint(RuntimeError):
  """A checkpoint whose contents differ from its checksums."""


class Checkpointer:
  """Saves and restores (TrainState, data iterator) pairs under one directory.

  Args:
    directory: where step directories live.
    keep: how many of the newest checkpoints to keep.
  """

  def __init__(self, directory: str | os.PathLike, keep: int):
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
    directory = paths.path(directory)
    # Orbax writes a gs:// directory through tensorstore's gcs driver, and on object storage marks a step complete
    # with a commit_success.txt object instead of renaming its temporary directory.
    self._directory = directory.absolute() if paths.is_local(directory) else directory
    self._manager = ocp.CheckpointManager(self._directory, options=options,
                                          item_names=("state", "data", "pipeline", "checksums"))

  def steps(self) -> list[int]:
    """The steps of complete checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: TrainState, data_iterator: Any, pipeline: Any = None) -> None:
    """Starts saving; device buffers are copied before this returns, so `state` may be donated next.

    `pipeline` is an optional pytree of host (numpy) arrays saved beside the
    state: the step function's work in flight. Every process calls this.
    """
    sums = {"state": checksums.array_checksums(state),
            "data": checksums.gathered(checksums.host_checksum(data_iterator.get_state()))}
    items = {"state": ocp.args.StandardSave(state), "data": grain.checkpoint.CheckpointSave(data_iterator)}
    if pipeline is not None:
      items["pipeline"] = ocp.args.StandardSave(pipeline)
      sums["pipeline"] = checksums.host_checksum(pipeline)
    items["checksums"] = ocp.args.JsonSave(sums)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, abstract_state: TrainState, data_iterator: Any) -> tuple[int, TrainState, Any] | None:
    """Restores the newest intact checkpoint into `data_iterator`; None when there is none.

    Args:
      abstract_state: ShapeDtypeStructs with the target shardings (any mesh).
      data_iterator: a fresh iterator of the same pipeline; its state is set.

    Returns:
      (step, state, pipeline), or None when no checkpoint exists; `pipeline`
      is the saved host arrays, or None when the step saved none.

    Raises:
      CheckpointError: when checkpoints exist but every one is damaged.
      Exception: any restore error that is not damage, unchanged.
    """
    errors = []
    for step in reversed(self.steps()):
      try:
        restored = self._restore_verified(step, abstract_state, data_iterator)
      except Exception as e:
        if not _is_damage(e):
          raise
        log.warning("checkpoint step %d is damaged (%s); trying the previous one", step, _describe(e))
        errors.append(f"step {step}: {_describe(e)}")
        continue
      self._set_aside(damaged=[s for s in self.steps() if s > step])
      return restored
    if errors:
      raise CheckpointError(f"no checkpoint in {self._directory} can be restored; every one is damaged:\n  "
                            + "\n  ".join(errors))
    return None

  def _restore_verified(self, step: int, abstract_state: TrainState, data_iterator: Any):
    """(step, state, pipeline) of one step, checked against its checksums."""
    directory = self._directory / str(step)
    if not (directory / "checksums").exists():
      # Every save writes one; without it nothing in the step can be verified, so it is damage, not a pass.
      raise DamagedCheckpoint(f"{directory}: no checksums item (every checkpoint is saved with one), so its "
                              "contents cannot be verified")
    items = {"state": ocp.args.StandardRestore(abstract_state),
             "data": grain.checkpoint.CheckpointRestore(data_iterator),
             "checksums": ocp.args.JsonRestore()}
    if (directory / "pipeline").exists():
      items["pipeline"] = ocp.args.StandardRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    pipeline = restored.get("pipeline")
    expected = restored["checksums"]
    actual = {"state": checksums.array_checksums(restored["state"]),
              "data": checksums.host_checksum(data_iterator.get_state())}
    if pipeline is not None:
      actual["pipeline"] = checksums.host_checksum(pipeline)
    bad = [path for path, value in expected["state"].items() if actual["state"].get(path) != value]
    if set(actual["state"]) != set(expected["state"]):
      bad.append("the set of arrays")
    if expected["data"][jax.process_index()] != actual["data"]:
      bad.append("the data position")
    if expected.get("pipeline") != actual.get("pipeline"):
      bad.append("the pipeline's batches sampled ahead")
    if bad:
      raise DamagedCheckpoint(f"{directory}: contents differ from the checksums written with them: "
                              f"{', '.join(bad[:5])}{' and more' if len(bad) > 5 else ''}")
    return step, restored["state"], pipeline

  def _set_aside(self, damaged: list[int]) -> None:
    """Moves unrestorable steps to `<directory>.damaged/` so the run can write those steps again."""
    for step in damaged:
      target = self._directory.with_name(self._directory.name + ".damaged") / str(step)
      target.parent.mkdir(exist_ok=True)
      paths.remove(target)  # set aside by an earlier resume that was itself interrupted
      # Locally a rename; on object storage a server-side copy of each object, then its deletion.
      (self._directory / str(step)).rename(target)
      log.warning("moved the damaged checkpoint of step %d to %s", step, target)
    if damaged:
      self._manager.reload()

  def wait(self) -> None:
    """Blocks until background saves are written."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.close()


def _chain(e: BaseException) -> Iterator[BaseException]:
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


def _is_damage(e: BaseException) -> bool:
  """Whether a restore error says the files are damaged (not a mismatch, permission or transient failure)."""
  for link in _chain(e):
    if isinstance(link, (DamagedCheckpoint, *_DAMAGE_TYPES)):
      return True
    if isinstance(link, PermissionError):
      return False
    if any(marker in str(link) for marker in _DAMAGE_MARKERS):
      return True
  return False


def _describe(e: BaseException) -> str:
  """The innermost informative line of an error chain, short."""
  links = list(_chain(e))
  text = f"{type(links[-1]).__name__}: {links[-1]}" if len(links) > 1 else f"{type(e).__name__}: {e}"
  return text.splitlines()[0][:300] if text else type(e).__name__
