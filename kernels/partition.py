"""How attention arrays are laid out over a mesh inside `shard_map`.

Batch and heads may be sharded too (data/fsdp and tensor in ptx); only mesh
axes that exist with more than one device are named, so the same call works on
a laptop mesh and a pod.
"""

import jax


def present_axes(mesh: jax.sharding.Mesh, names: tuple[str, ...]):
  """The axes of `names` that `mesh` has with size > 1, or None."""
  names = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
  return names or None
