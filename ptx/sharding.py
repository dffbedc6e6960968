"""The device mesh, the logical-axis glossary and the one rules table.

Model code names logical axes only; this module maps them to mesh axes.

Logical axes:
  batch     sequences of a batch
  seq       token positions of a sequence
  embed     the residual stream (d_model)
  heads     query heads
  kv_heads  key/value heads
  head_dim  width of one attention head
  mlp       hidden units of the MLP (and of each expert's)
  experts   the experts of a Mixture-of-Experts layer's weights
  vocab     vocabulary entries
  layers    the stacked-layer axis of scanned parameters
  lora_rank the rank of a low-rank adapter (never sharded: it is small)

Mesh axes, outermost first: `data` (replicated-parameter data parallelism),
`fsdp` (data parallelism with sharded parameters and optimizer state),
`expert` (expert parallelism), `tensor` (model parallelism) and `seq`
(context parallelism).

Parameters and activations follow separate rules of one `Rules` table: with
FSDP the parameter rule shards `embed` over `fsdp` while activations stay
batch-sharded over (`data`, `fsdp`). A mesh axis that does not divide a
dimension is dropped for that array (it is replicated along it) instead of
failing, so a model with 2 KV heads runs on `tensor` = 4.

Expert parallelism (MaxText's layout): expert weights split their `experts`
dimension over `expert`; every other weight shards `embed` over (`fsdp`,
`expert`) and the batch splits over (`data`, `fsdp`, `expert`), so the axis
doubles as an FSDP axis and nothing is replicated along it. An array's
`experts` dimension claims its mesh axes first: the other dimensions of that
array leave them out (an expert weight's `embed` splits over `fsdp` alone).
An `expert` axis of size 1 is left out of every spec, so a mesh without
expert parallelism lays every array out as before the axis existed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ptx.config import MeshConfig

MESH_AXES = ("data", "fsdp", "expert", "tensor", "seq")
LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts", "vocab", "layers",
                "lora_rank")

AxisRule = str | tuple[str, ...] | None
Names = tuple[str | None, ...]


def as_tuple(rule: AxisRule) -> tuple[str, ...]:
  """The mesh axes of a rule or of a PartitionSpec entry (None, one axis or several), as a tuple."""
  if rule is None:
    return ()
  return (rule,) if isinstance(rule, str) else tuple(rule)


@dataclasses.dataclass(frozen=True)
class Rules:
  """Logical axis -> mesh axes, one mapping for parameters, one for activations."""

  params: dict[str, AxisRule]
  activations: dict[str, AxisRule]

  def __hash__(self):
    # Rules are static configuration (held by modules, closed over by jit).
    return hash(tuple(tuple(sorted(getattr(self, k).items())) for k in ("params", "activations")))

  def __post_init__(self):
    for kind in ("params", "activations"):
      table = getattr(self, kind)
      for name, rule in table.items():
        if name not in LOGICAL_AXES:
          raise ValueError(f"Rules.{kind}: unknown logical axis {name!r}; known: {LOGICAL_AXES}")
        for axis in as_tuple(rule):
          if axis not in MESH_AXES:
            raise ValueError(f"Rules.{kind}[{name!r}]: unknown mesh axis {axis!r}; known: {MESH_AXES}")


DEFAULT_RULES = Rules(
    params={
        "embed": ("fsdp", "expert"),
        "experts": "expert",
        "heads": "tensor",
        "kv_heads": "tensor",
        "mlp": "tensor",
        "vocab": "tensor",
    },
    activations={
        "batch": ("data", "fsdp", "expert"),
        "seq": "seq",
        "heads": "tensor",
        "kv_heads": "tensor",
        "mlp": "tensor",
        "vocab": "tensor",
    },
)


def rules_of(cfg: MeshConfig) -> Rules:
  """DEFAULT_RULES with the config's overrides (`mesh.param_rules`, `mesh.activation_rules`).

  Raises:
    ValueError: naming the field and entry that is not "logical=axis[,axis]" or names an unknown axis.
  """
  tables = {}
  for kind, field in (("params", "param_rules"), ("activations", "activation_rules")):
    table = dict(getattr(DEFAULT_RULES, kind))
    for entry in getattr(cfg, field):
      name, sep, axes = entry.partition("=")
      if not sep:
        raise ValueError(f"mesh.{field}: {entry!r} is not of the form logical=mesh_axis[,mesh_axis]")
      rule = tuple(a.strip() for a in axes.split(",") if a.strip())
      table[name.strip()] = None if not rule else rule[0] if len(rule) == 1 else rule
    tables[kind] = table
  try:
    return Rules(**tables)
  except ValueError as e:
    raise ValueError(f"mesh.param_rules / mesh.activation_rules: {e}") from e


def resolve_mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, ...]:
  """Returns the mesh shape in MESH_AXES order, filling in the one -1 axis."""
  sizes = [getattr(cfg, name) for name in MESH_AXES]
  free = [i for i, s in enumerate(sizes) if s == -1]
  if len(free) > 1:
    raise ValueError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  if any(s < 1 and s != -1 for s in sizes):
    raise ValueError(f"mesh: sizes must be positive or -1, got {dict(zip(MESH_AXES, sizes))}")
  fixed = math.prod(s for s in sizes if s != -1)
  if free:
    if n_devices % fixed:
      raise ValueError(f"mesh: {n_devices} devices do not split over fixed axes of size {fixed}")
    sizes[free[0]] = n_devices // fixed
  if math.prod(sizes) != n_devices:
    raise ValueError(
        f"mesh: {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, have {n_devices}")
  return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the ("data", "fsdp", "expert", "tensor", "seq") mesh with Auto axis types.

  Args:
    cfg: axis sizes; one may be -1 for "the remaining devices".
    devices: defaults to `jax.devices()`, which on a multi-host run lists
      every process's devices, so all hosts build the same global mesh
      (jax.make_mesh orders them by physical topology on TPU).

  Returns:
    A `jax.sharding.Mesh` whose axes are all `AxisType.Auto` (GSPMD
    propagation; jax 0.10 would otherwise default to Explicit).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(cfg, len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def logical_to_spec(
    names: Names,
    rules: Rules = DEFAULT_RULES,
    *,
    kind: Literal["params", "activations"] = "activations",
    shape: Sequence[int] | None = None,
    mesh: Mesh | jax.sharding.AbstractMesh | None = None,
) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec.

  With `shape` and `mesh`, mesh axes that do not divide their dimension (or
  are absent from the mesh, or are `expert` of size 1) are dropped,
  replicating that dimension. An `experts` dimension claims its mesh axes
  first; the other dimensions leave them out (module docstring).

  Raises:
    ValueError: when two logical axes map to the same mesh axis, or a name is
      not in the glossary.
  """
  table = getattr(rules, kind)
  for name in names:
    if name is not None and name not in LOGICAL_AXES:
      raise ValueError(f"unknown logical axis {name!r}; known: {LOGICAL_AXES}")
  fit = lambda i, axes: axes if mesh is None else _fitting_axes(axes, None if shape is None else shape[i], mesh)
  claimed = {axis for i, name in enumerate(names) if name == "experts" for axis in fit(i, as_tuple(table.get(name)))}
  used: dict[str, str] = {}
  spec = []
  for i, name in enumerate(names):
    axes = as_tuple(table.get(name))
    axes = fit(i, axes if name == "experts" else tuple(axis for axis in axes if axis not in claimed))
    for axis in axes:
      if axis in used:
        raise ValueError(
            f"logical axes {used[axis]!r} and {name!r} of {names} both map to mesh axis {axis!r}")
      used[axis] = name
    spec.append(axes[0] if len(axes) == 1 else (axes or None))
  return PartitionSpec(*spec)


def named_shardings(
    names_tree: Any,
    shapes_tree: Any,
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
    *,
    kind: Literal["params", "activations"] = "params",
) -> Any:
  """Returns a tree of NamedSharding for a tree of logical names and shapes.

  Args:
    names_tree: pytree whose leaves are tuples of logical names.
    shapes_tree: the same structure, leaves with `.shape` (arrays,
      ShapeDtypeStructs) or tuples of ints.
    mesh: the device mesh.
    rules: the rules table.
    kind: which rule set to apply.
  """

  def one(names, leaf):
    shape = leaf if isinstance(leaf, tuple) else leaf.shape
    if len(names) != len(shape):
      raise ValueError(f"logical axes {names} do not match shape {shape}")
    return NamedSharding(mesh, logical_to_spec(names, rules, kind=kind, shape=shape, mesh=mesh))

  return jax.tree.map(one, names_tree, shapes_tree, is_leaf=_is_names)


def constrain(x: jax.Array, names: Names, rules: Rules = DEFAULT_RULES) -> jax.Array:
  """Constrains an activation's layout by logical names under the current mesh.

  A no-op when no mesh is set (`jax.set_mesh`), so model code runs unchanged
  on one device.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  spec = logical_to_spec(names, rules, kind="activations", shape=x.shape, mesh=mesh)
  return jax.lax.with_sharding_constraint(x, spec)


def batch_sharding(mesh: Mesh, ndim: int = 2, rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """The sharding of a [batch, seq, ...] input array."""
  names = ("batch", "seq") + (None,) * (ndim - 2)
  return NamedSharding(mesh, logical_to_spec(names[:ndim], rules, kind="activations", mesh=mesh))


def _fitting_axes(axes: tuple[str, ...], dim: int | None, mesh) -> tuple[str, ...]:
  """The longest prefix of `axes` present in `mesh` whose product divides `dim`, less an `expert` axis of size 1."""
  kept, size = [], 1
  for axis in axes:
    if axis not in mesh.axis_names:
      break
    n = mesh.shape[axis]
    if axis == "expert" and n == 1:
      continue
    if dim is not None and dim % (size * n):
      break
    kept.append(axis)
    size *= n
  return tuple(kept)


def _is_names(x: Any) -> bool:
  return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)
