"""Loading an HF checkpoint directory into a sharded ptx `Decoder`.

Invariants:
  * Everything is checked before any tensor is read: the config, each file's
    size against its safetensors header (a cut download or copy is named
    with both sizes), and the name, presence and shape of every tensor
    (from the headers). An error names the tensor and its file; nothing is
    half-loaded.
  * Each parameter is built with `jax.make_array_from_callback` straight into
    its target sharding. The callback reads, with safetensors `get_slice`, only
    the rows of the device's block, one layer at a time, into one host buffer
    per distinct block (replicas share it). So host memory holds at most one
    parameter's worth of staging at a time, never the model twice, and on
    multi-host each process reads only what its own devices hold.
  * A file is opened per parameter and closed after it, so its pages do not
    stay mapped (and counted in the resident set) for the rest of the load.
  * A directory on object storage (gs://, `ptx.paths`) is downloaded into a
    temporary local directory first (safetensors maps local files), deleted
    once the parameters are built; its config is read in place.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from ptx import paths, sharding
from ptx.model_config import ModelConfig
from ptx.models import hf_layout
from ptx.models.decoder import Decoder
from ptx.models.hf_config import HFFamily, family_of, model_config
from ptx.models.params import ParamSpec, param_shardings, param_specs

# Buffers that old checkpoints saved and that hold nothing to load.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
  """A checkpoint whose files are unreadable or whose tensors do not match its config (names the tensor and file)."""


def load_hf(path: str | os.PathLike, *, mesh: Mesh | None = None, dtype: Any = None,
            rules: sharding.Rules = sharding.DEFAULT_RULES) -> Decoder:
  """Loads an HF model directory (config.json + safetensors) as a ptx Decoder.

  Args:
    path: a directory, local or gs://, with `config.json` and
      `model.safetensors` or a sharded `model.safetensors.index.json`.
    mesh: place every parameter with its sharding on this mesh; None puts the
      model on this process's first device.
    dtype: parameter and compute dtype; None keeps the checkpoint's
      `torch_dtype` (float32 when it has none).
    rules: the sharding rules of the model.

  Returns:
    The Decoder, its config built from config.json.

  Raises:
    HFConfigError: for an unsupported model_type or config option.
    CheckpointError: for a cut or unreadable safetensors file, or a
      missing, unexpected or wrongly shaped tensor.
    FileNotFoundError: when the directory holds no config or weights.
  """
  path = paths.path(path)
  cfg, family = _config(path, dtype)
  specs = param_specs(cfg)
  if mesh is None:
    shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.local_devices()[0]), specs, is_leaf=_is_spec)
  else:
    shardings = param_shardings(cfg, mesh, rules)
  np_dtype = np.dtype(jnp.dtype(cfg.param_dtype))
  with paths.local_copy(path) as local:
    sources = _match(specs, cfg, family, _headers(local), local)
    params = {
        key: ({leaf: _load(specs[key][leaf], leaf, sources[f"{key}/{leaf}"], shardings[key][leaf], np_dtype)
               for leaf in specs[key]} if isinstance(specs[key], dict) else
              _load(specs[key], key, sources[key], shardings[key], np_dtype))
        for key in specs
    }
  return Decoder(cfg, params=params, rules=rules)


def read_model_config(path: str | os.PathLike, *, dtype: Any = None) -> ModelConfig:
  """The ModelConfig of an HF model directory's config.json, without reading any weights.

  Raises:
    HFConfigError: for an unsupported model_type or config option.
    FileNotFoundError: when the directory holds no config.json.
  """
  return _config(paths.path(path), dtype)[0]


def _config(path: paths.Path, dtype: Any) -> tuple[ModelConfig, HFFamily]:
  where = path / "config.json"
  if not where.is_file():
    raise FileNotFoundError(f"{where}: no such file (an HF model directory holds config.json and safetensors)")
  try:
    hf = json.loads(where.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: not valid JSON ({e})") from e
  family = family_of(hf, str(where))
  return model_config(hf, family, None if dtype is None else jnp.dtype(dtype).name, str(where)), family


def _headers(path: pathlib.Path) -> dict[str, tuple[pathlib.Path, tuple[int, ...]]]:
  """Checkpoint tensor name -> (file, shape), read from the safetensors headers only."""
  index = path / "model.safetensors.index.json"
  if index.exists():
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted({path / f for f in weight_map.values()})
  elif (path / "model.safetensors").exists():
    weight_map, files = None, [path / "model.safetensors"]
  else:
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
  out = {}
  for file in files:
    _check_size(file)
    with _open(file) as f:
      for name in f.keys():
        out[name] = (file, tuple(f.get_slice(name).get_shape()))
  for name, file in (weight_map or {}).items():
    if out.get(name, (None,))[0] != path / file:
      raise CheckpointError(f"{index}: names tensor {name!r} in {file}, which does not hold it")
  return out


def _check_size(file: pathlib.Path) -> None:
  """Raises CheckpointError naming `file` when it is shorter than its safetensors header says."""
  size = os.path.getsize(file)
  with open(file, "rb") as f:
    prefix = f.read(8)
    header_len = int.from_bytes(prefix, "little")
    if len(prefix) < 8 or 8 + header_len > size:
      what = "a safetensors header" if len(prefix) < 8 else f"the {header_len}-byte safetensors header it announces"
      raise CheckpointError(f"{file}: {size} bytes, too short for {what}: the file is cut short (an interrupted "
                            "download or copy?) or not a safetensors file")
    try:
      header = json.loads(f.read(header_len))
      end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
      raise CheckpointError(f"{file}: not a safetensors file (its header does not parse: {e})") from None
  if 8 + header_len + end > size:
    raise CheckpointError(f"{file}: {size} bytes, but its safetensors header describes {8 + header_len + end}: the "
                          "tensor data is cut short (an interrupted download or copy?)")


def _open(file: pathlib.Path) -> Any:
  """safetensors' `safe_open` of `file`, its errors raised as CheckpointError naming the file."""
  from safetensors import SafetensorError, safe_open

  try:
    return safe_open(str(file), framework="np")
  except SafetensorError as e:
    raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None


def _match(specs: dict[str, Any], cfg: ModelConfig, family: HFFamily,
           headers: dict[str, tuple[pathlib.Path, tuple[int, ...]]], path: pathlib.Path) -> dict[str, list[tuple]]:
  """Pairs every ptx parameter with its per-layer (file, tensor name); checks names and shapes."""
  found = {}
  for name, (file, shape) in headers.items():
    canonical = name
    for old, new in family.aliases:
      if name.startswith(old):
        canonical = new + name[len(old):]
        break
    skip = name.startswith(family.ignored) or name.endswith(_SKIPPED_SUFFIXES)
    if not skip and not (cfg.tie_embeddings and canonical == family.names["lm_head"]):
      found[canonical] = (name, file, shape)
  sources, expected = {}, set()
  for key, spec in _flat(specs):
    stacked = spec.logical_axes[0] == "layers"
    leaf = key.split("/")[-1]
    axes, shape = (spec.logical_axes[1:], spec.shape[1:]) if stacked else (spec.logical_axes, spec.shape)
    experts = shape[0] if hf_layout.per_expert(axes) else 1
    if hf_layout.per_expert(axes):  # one HF tensor per expert
      axes, shape = axes[1:], shape[1:]
    want = hf_layout.hf_shape(leaf, axes, shape)
    layers = cfg.stack_layers(key.split("/")[0]) if stacked else (0,)
    names = [family.names[key].format(i=i, e=e) for i in layers for e in range(experts)]
    missing = [n for n in names if n not in found]
    if missing:
      raise CheckpointError(f"{path}: missing tensor {missing[0]!r} (ptx {key}; {len(missing)} missing for it)")
    for n in names:
      name, file, shape_found = found[n]
      if shape_found != want:
        raise CheckpointError(f"{file}: tensor {name!r} has shape {list(shape_found)}, expected {list(want)} "
                              f"for ptx {key} of the config")
    sources[key] = [[(found[n][1], found[n][0]) for n in names[i:i + experts]]
                    for i in range(0, len(names), experts)]
    expected.update(names)
  for canonical, (name, file, _) in found.items():
    if canonical not in expected:
      raise CheckpointError(f"{file}: unexpected tensor {name!r} for {family.model_type} with this config")
  return sources


def _load(spec: ParamSpec, leaf: str, sources: list[list[tuple[pathlib.Path, str]]], target: jax.sharding.Sharding,
          dtype: np.dtype) -> jax.Array:
  """Builds one parameter on its sharding, reading each distinct device block once.

  `sources[i]` lists layer i's HF tensors: one, or one per expert, of which a
  block reads only the experts it holds.
  """
  stacked = spec.logical_axes[0] == "layers"
  axes, shape = (spec.logical_axes[1:], spec.shape[1:]) if stacked else (spec.logical_axes, spec.shape)
  handles: dict[pathlib.Path, Any] = {}
  blocks: dict[tuple, np.ndarray] = {}

  def read_tensor(source: tuple[pathlib.Path, str], axes, shape, block: tuple[slice, ...]) -> np.ndarray:
    file, name = source
    if file not in handles:
      handles[file] = _open(file)
    tensor = handles[file].get_slice(name)
    return hf_layout.read_block(lambda index: tensor[index], leaf, axes, shape, block)

  def read_layer(i: int, block: tuple[slice, ...]) -> np.ndarray:
    if not hf_layout.per_expert(axes):
      return read_tensor(sources[i][0], axes, shape, block)
    return np.stack([read_tensor(sources[i][e], axes[1:], shape[1:], block[1:])
                     for e in range(block[0].start, block[0].stop)])

  def callback(index: tuple[slice, ...]) -> np.ndarray:
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, spec.shape))
    key = tuple((s.start, s.stop) for s in index)
    if key not in blocks:
      if stacked:
        out = np.empty([s.stop - s.start for s in index], dtype)
        for j, i in enumerate(range(index[0].start, index[0].stop)):
          out[j] = read_layer(i, index[1:])
      else:
        out = read_layer(0, index).astype(dtype)
      blocks[key] = out
    return blocks[key]

  try:
    return jax.make_array_from_callback(spec.shape, target, callback)
  finally:
    handles.clear()
    blocks.clear()


def _flat(specs: dict[str, Any]) -> list[tuple[str, ParamSpec]]:
  """("embed", spec), ("layers/q", spec), ... in tree order."""
  out = []
  for key, value in specs.items():
    if isinstance(value, dict):
      out += [(f"{key}/{leaf}", spec) for leaf, spec in value.items()]
    else:
      out.append((key, value))
  return out


def _is_spec(x: Any) -> bool:
  return isinstance(x, ParamSpec)
