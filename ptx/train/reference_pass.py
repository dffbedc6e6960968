"""Reference log-probs precomputed once in a pass over the preference data.

The alternative to a frozen reference copy for DPO-family losses: one
forward pass of the initial parameters over every pair of the source gives a
table [records, 2] of summed reference log-probs (chosen, rejected), saved to
the run directory. Training batches then carry their pairs' entries
(`WithReferenceLogps`, keyed by each pair's `record_index`), so the training
step holds no second parameter tree and runs no reference forward. On a
multi-host job every host computes its shard of the pass and gathers the
whole table.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable, Iterable, Iterator, Sequence

import grain
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from ptx import sharding
from ptx.algorithms import dpo
from ptx.config import Config
from ptx.model_config import ModelConfig
from ptx.data.global_batch import to_global
from ptx.models.params import param_shardings
from ptx.sharding import make_mesh
from ptx.train.state import initial_params


def precompute(params: Any, batches: Iterable[dict[str, Any]], *, num_records: int, model: ModelConfig, mesh: Mesh,
               rules: sharding.Rules = sharding.DEFAULT_RULES) -> np.ndarray:
  """Summed log-probs of every pair under `params`.

  Args:
    params: the reference parameters (the initial model).
    batches: one pass of host preference batches with `record_index`
      (`ptx.data.make_pipeline` with kind "preference", one epoch).
    num_records: records in the source.
    model: the model config.
    mesh: the device mesh.
    rules: sharding rules.

  Returns:
    float32 [num_records, 2]: (chosen, rejected) per record; NaN for records
    the pass dropped (bad or overlong records).
  """

  @jax.jit
  def logps(params, batch):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      out = dpo.prepare(params, batch, model=model, rules=rules)
    return batch["record_index"], jax.numpy.stack([out["ref_chosen_logps"], out["ref_rejected_logps"]], axis=1)

  table = np.full((num_records, 2), np.nan, np.float32)
  for host_batch in batches:
    index, values = (np.asarray(multihost_utils.process_allgather(x, tiled=True))
                     for x in logps(params, to_global(host_batch, mesh, rules)))
    kept = index >= 0  # filler rows of a short last batch
    if (index[kept] >= num_records).any():
      raise ValueError(f"record_index {index.max()} outside the source's {num_records} records")
    table[index[kept]] = values[kept]
  return table


def with_reference_table(dataset: Iterable[dict[str, Any]], *, source: Sequence[Any],
                         pipeline: Callable[..., Iterable[dict[str, Any]]], cfg: Config,
                         path: pathlib.Path, init_params: Any = None) -> "WithReferenceLogps":
  """`dataset` with the precomputed reference log-probs of `source`'s pairs under the job's initial parameters.

  Args:
    dataset: the training (or evaluation) pipeline over `source`.
    source: the random-access record source.
    pipeline: `pipeline(source, cfg=DataConfig)` builds a pipeline of this
      host (`ptx.data.make_pipeline` with the tokenizer and host bound).
    cfg: the job config (model, mesh, seed, data).
    path: the table's file; a resumed run reads it instead of recomputing.
    init_params: the parameters training starts from (pretrained weights;
      under LoRA the base); None: the fresh init of `cfg.train.seed`.

  Returns:
    The wrapped dataset.
  """
  mesh = make_mesh(cfg.mesh)

  def compute() -> np.ndarray:
    start = initial_params(cfg.model, cfg.train.seed) if init_params is None else init_params
    rules = sharding.rules_of(cfg.mesh)
    params = jax.device_put(start, param_shardings(cfg.model, mesh, rules))
    one_pass = dataclasses.replace(cfg.data, shuffle=False, num_epochs=1)
    return precompute(params, pipeline(source, cfg=one_pass), num_records=len(source), model=cfg.model, mesh=mesh,
                      rules=rules)

  return WithReferenceLogps(dataset, load_or_precompute(path, compute, len(source)))


def load_or_precompute(path: pathlib.Path, compute: Callable[[], np.ndarray], num_records: int) -> np.ndarray:
  """The table saved at `path` (a resumed run), else `compute()`'s, saved there by process 0."""
  if path.exists():
    with path.open("rb") as f:  # a local or gs:// file (`ptx.paths`)
      table = np.load(f)
    if table.shape != (num_records, 2):
      raise ValueError(f"{path}: reference table of shape {table.shape}, but the data has {num_records} records; "
                       "delete it to recompute")
    return table
  table = compute()
  if jax.process_index() == 0:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
      np.save(f, table)
  return table


class WithReferenceLogps(grain.IterDataset):
  """A preference pipeline whose batches also carry `ref_chosen_logps` / `ref_rejected_logps` [B] from a table.

  Args:
    dataset: the preference pipeline (`ptx.data.make_pipeline`).
    table: `precompute`'s [records, 2] table.
  """

  def __init__(self, dataset: Iterable[dict[str, Any]], table: np.ndarray):
    super().__init__()
    self.dataset, self.table = dataset, table

  def __iter__(self) -> "_ReferenceIterator":
    return _ReferenceIterator(iter(self.dataset), self.table)


class _ReferenceIterator(grain.DatasetIterator):
  """Adds the table's entries to each batch; its state is the wrapped iterator's."""

  def __init__(self, batches: Iterator[dict[str, Any]], table: np.ndarray):
    super().__init__()
    self._batches, self._table = batches, table

  def __next__(self) -> dict[str, Any]:
    batch = next(self._batches)
    index = batch["record_index"]
    values = np.where((index >= 0)[:, None], self._table[np.maximum(index, 0)], 0.0)
    if np.isnan(values).any():
      raise ValueError(f"records {sorted(set(index[np.isnan(values).any(axis=1)].tolist()))} have no precomputed "
                       "reference log-probs (dropped by the reference pass)")
    return {**batch, "ref_chosen_logps": values[:, 0], "ref_rejected_logps": values[:, 1]}

  def get_state(self) -> dict[str, Any]:
    return self._batches.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._batches.set_state(state)

  def metrics(self) -> dict[str, int | float]:
    """The wrapped pipeline's counters."""
    return self._batches.metrics()

  def skip_reasons(self) -> list[str]:
    """The wrapped pipeline's first skipped or dropped records."""
    return self._batches.skip_reasons()
