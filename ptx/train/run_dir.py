"""A run directory belongs to one run: claiming it, and what a resumed run may change.

`check(out, resume=..., overwrite=...)` is called before anything is
written into `out` (on a multi-host job by process 0, `agreed`): a directory that holds an earlier run (its
`config.json`, `metrics.jsonl` or `checkpoints/`) is refused unless the
caller continues it (`resume`) or replaces it (`overwrite`); a run that
stopped before its first metrics line and checkpoint (`failed_start`) is
replaced by a new start as if overwritten. Replacing
happens in two steps, so that a new run that fails while it is prepared
(bad data, a bad checkpoint) loses nothing but caches: the command line
first clears `CACHES` (files derived from the earlier run's config, which
preparing the new run would otherwise reuse), and `ptx.fit` clears
`RESULTS` (checkpoints, metrics, exports) when it starts training. Data
files in the directory stay.

`check_resume(saved, now)` compares the config a run was started with
(its `config.json`) to the config it is resumed with: only
`RESUMABLE_FIELDS` may differ (the run's length, logging, sample transcripts, evaluation,
checkpoint cadence, and how the same program is laid out and executed);
anything else changes the model or the data stream, and is refused with
the fields that differ.
"""

from __future__ import annotations

import fnmatch
import json
import os
from typing import Any, Callable

import jax
import numpy as np

from ptx import paths

# What marks a directory as holding a run: `fit` writes config.json first.
_MARKERS = ("config.json", "metrics.jsonl", "checkpoints")
# Derived from a run's config before training: DPO's reference table, a converted GGUF checkpoint.
CACHES = ("reference_logps", "pretrained")
# What training and export write.
RESULTS = ("config.json", "metrics.jsonl", "metrics.jsonl.tmp", "checkpoints", "checkpoints.damaged",
           "tensorboard", "hf", "adapter", "base", "plots", "evals", "samples")
# Config fields a resumed run may change (shell patterns over "section.field").
RESUMABLE_FIELDS = ("train.steps", "train.log_every", "train.eval_every", "train.checkpoint_every",
                    "train.keep_checkpoints", "train.max_nonfinite_steps", "train.memory_check", "data.eval_files",
                    "data.num_threads", "data.prefetch", "mesh.*", "model.remat", "model.attention_impl",
                    "model.ring_heads_per_pass", "model.logits_chunk", "eval.every", "eval.regression",
                    "grpo.samples_*")


class RunDirError(ValueError):
  """A run directory that the requested start would overwrite, or a resume that would change the run."""


def check(out: str | os.PathLike, *, resume: bool, overwrite: bool) -> None:
  """Refuses to start in `out` over an earlier run unless resuming or overwriting it; changes nothing.

  Raises:
    paths.PathError: `out` is not a path ptx can write (`ptx.paths.path`).
    RunDirError: `out` holds an earlier run and neither `resume` nor
      `overwrite` is set, or both are.
  """
  if resume and overwrite:
    raise RunDirError("--resume continues the run in the directory and --overwrite replaces it: pass one")
  out = paths.path(out)
  earlier = [name for name in _MARKERS if (out / name).exists()]
  if earlier and not (resume or overwrite or failed_start(out)):
    raise RunDirError(f"{out} holds an earlier run ({', '.join(earlier)}): pass --resume to continue it, "
                      "--overwrite to replace it (deletes its checkpoints, metrics and exports), or another --out")


def failed_start(out: str | os.PathLike) -> bool:
  """Whether `out` holds only the start of a run that stopped before its first metrics line and first checkpoint.

  Such a run (out of memory in its first step, a bad batch, a kill) left its config.json and perhaps an empty
  metrics file, nothing a rerun would not write again: a new start replaces it as `--overwrite` would (`replaces`),
  where a run with a metrics line or a checkpoint is refused.
  """
  out = paths.path(out)
  if not (out / "config.json").exists():
    return False
  metrics = out / "metrics.jsonl"
  if metrics.exists() and metrics.read_text().strip():
    return False
  checkpoints = out / "checkpoints"
  return not (checkpoints.exists() and any(p.name.isdigit() for p in checkpoints.iterdir()))


def replaces(out: str | os.PathLike, *, resume: bool, overwrite: bool) -> bool:
  """Whether a start in `out` replaces what is there (its caches, then its results): `overwrite`, or a new start
  (not a resume) over a `failed_start`."""
  return overwrite or (not resume and failed_start(out))


def agreed(verdict: Callable[[], None]) -> None:
  """Runs a check (`verdict` raises RunDirError to refuse) on process 0 only, and refuses on every process if it did.

  Every host of a multi-host job writes into the same run directory, so
  one process judges it, before any writes, and all of them stop alike;
  with one process this is `verdict()`. Every process must call it.
  """
  error = None
  if jax.process_index() == 0:
    try:
      verdict()
    except RunDirError as e:
      error = e
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    refused = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
    if refused and error is None:
      raise RunDirError("process 0 refused the run directory; its output says why")
  if error is not None:
    raise error


def clear(out: str | os.PathLike, names: tuple[str, ...], *, primary: bool = True) -> None:
  """Deletes `out/name` for each of `names` that exists (on the primary process of a multi-host job only)."""
  if not primary:
    return
  for name in names:
    paths.remove(paths.path(out) / name)


def saved_config(out: str | os.PathLike) -> dict[str, Any] | None:
  """The config tree a run in `out` was started with, or None when it has none.

  Raises:
    RunDirError: config.json is not valid JSON.
  """
  path = paths.path(out) / "config.json"
  if not path.exists():
    return None
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise RunDirError(f"{path}: not valid JSON ({e}); cannot check that --resume continues the same run") from e


def check_resume(saved: dict[str, Any], now: dict[str, Any], where: str | os.PathLike) -> None:
  """Refuses to resume when `now` differs from `saved` outside `RESUMABLE_FIELDS`.

  Raises:
    RunDirError: naming each differing field with its saved and new value.
  """
  before, after = _flat(saved), _flat(json.loads(json.dumps(now)))  # as saved: tuples become lists
  differ = [name for name in sorted(set(before) | set(after))
            if before.get(name) != after.get(name) and not any(fnmatch.fnmatch(name, p) for p in RESUMABLE_FIELDS)]
  if differ:
    lines = "\n".join(f"  {name}: {json.dumps(before.get(name))} in the run, {json.dumps(after.get(name))} now"
                      for name in differ)
    raise RunDirError(f"--resume of {where}: the config changes the model or the data stream:\n{lines}\n"
                      f"only these may change on resume: {', '.join(RESUMABLE_FIELDS)}; start a new run "
                      "(another --out) to change the rest")


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flat(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat
