"""Host-local batches assembled into global `jax.Array`s with the data sharding.

Each host reads `batch_size / process_count` rows (its own shard of the
stream, see `ptx.data.pipeline`); `to_global` hands them to
`jax.make_array_from_process_local_data`, which places them on the host's
devices under `ptx.sharding.batch_sharding(mesh)` (rows over the data axes,
tokens over `seq`; a row's image tiles, `ptx.data.batch.PER_ROW`, stay
whole with their row). Each host holds whole rows, so the `seq` mesh axis
must not span hosts.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ptx.data.batch import PER_ROW
from ptx.sharding import DEFAULT_RULES, Rules, batch_sharding


def to_global(batch: dict[str, Any], mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES) -> dict[str, Any]:
  """Turns every array of a host batch into a global, data-sharded jax.Array.

  Args:
    batch: a host batch; nested dicts (preference batches) are followed and
      non-array values (RL task fields) stay on the host as they are.
    mesh: the device mesh.
    rules: the sharding rules (the `batch` and `seq` activation rules place the rows).

  Returns:
    The same structure with [B, T] numpy arrays replaced by global arrays of
    shape [B * process_count, T].
  """
  out: dict[str, Any] = {}
  for key, value in batch.items():
    if isinstance(value, dict):
      out[key] = to_global(value, mesh, rules)
    elif isinstance(value, np.ndarray):
      # Only the rows of a per-row array split: its second axis counts tiles, not tokens.
      sharded = batch_sharding(mesh, 1 if key in PER_ROW else value.ndim, rules)
      out[key] = jax.make_array_from_process_local_data(sharded, value)
    else:
      out[key] = value
  return out
