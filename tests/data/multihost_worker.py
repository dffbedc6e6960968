"""One of two JAX processes of test_multihost.py: reads its shard, assembles the global batch."""

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: str, out: str) -> None:
  """Builds this host's batch, makes it global and saves the gathered tokens (process 0)."""
  jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
  import numpy as np
  from jax.experimental import multihost_utils

  from ptx.config import MeshConfig
  from ptx.data import ByteTokenizer, MemorySource, make_pipeline, to_global
  from ptx.sharding import batch_sharding, make_mesh
  from tests.data.test_multihost import CONFIG, RECORDS

  mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4, seq=1))
  pipeline = make_pipeline(MemorySource(RECORDS), ByteTokenizer(), CONFIG,
                           process_index=jax.process_index(), process_count=jax.process_count())
  batch = to_global(next(iter(pipeline)), mesh)
  assert batch["tokens"].sharding == batch_sharding(mesh) and batch["tokens"].shape == (CONFIG.batch_size, 32)
  gathered = {k: multihost_utils.process_allgather(v, tiled=True) for k, v in batch.items()}
  if process_id == 0:
    np.savez(out, **gathered)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
