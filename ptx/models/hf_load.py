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

FP8 checkpoints (config.json's `quantization_config` with quant_method "fp8"
and a `weight_block_size`, as DeepSeek-V3, Kimi K2 and Qwen's *-FP8 ship)
load dequantised: each float8 e4m3 weight is multiplied by the blocks of its
`weight_scale_inv` that cover the device's slice (`ptx.models.fp8_blocks`),
then cast to the parameter dtype; unquantised tensors load as they are. The
scales' shapes are checked with the other tensors', and `save_hf` writes such
a model unquantised, without a quantization_config.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from ptx import paths, sharding
from ptx.model_config import ModelConfig
from ptx.models import fp8_blocks, hf_layout
from ptx.models.decoder import Decoder
from ptx.models.hf_config import HFFamily, family_of, interleaved_rope_rows, model_config
from ptx.models.params import ParamSpec, param_shardings, param_specs

# Buffers that old checkpoints saved and that hold nothing to load.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
  """A checkpoint whose files are unreadable or whose tensors do not match its config (names the tensor and file)."""


class _Tensor(NamedTuple):
  """A tensor of a safetensors file, as its header describes it."""

  name: str
  file: pathlib.Path
  shape: tuple[int, ...]
  dtype: str  # safetensors' name: "F32", "BF16", "F8_E4M3", ...
  offset: int  # its first byte in the file


# An HF tensor to read and its FP8 scale grid (None: stored unquantised).
_Source = tuple[_Tensor, _Tensor | None]


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
      missing, unexpected or wrongly shaped tensor (an FP8 scale too).
    FileNotFoundError: when the directory holds no config or weights.
  """
  path = paths.path(path)
  cfg, family, block, hf = _config(path, dtype)
  rows = interleaved_rope_rows(hf, family, cfg)
  extra = (hf.get(family.extra_layers_key) or 0) if family.extra_layers_key else 0
  skipped = tuple(f"model.layers.{i}." for i in range(cfg.n_layers, cfg.n_layers + extra))
  specs = param_specs(cfg)
  if mesh is None:
    shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.local_devices()[0]), specs, is_leaf=_is_spec)
  else:
    shardings = param_shardings(cfg, mesh, rules)
  np_dtype = np.dtype(jnp.dtype(cfg.param_dtype))
  with paths.local_copy(path) as local:
    sources = _match(specs, cfg, family, _headers(local), local, block, skipped)
    params = {
        key: ({leaf: _load(specs[key][leaf], leaf, sources[f"{key}/{leaf}"], shardings[key][leaf], np_dtype, block,
                           rows.get(f"{key}/{leaf}")) for leaf in specs[key]} if isinstance(specs[key], dict) else
              _load(specs[key], key, sources[key], shardings[key], np_dtype, block))
        for key in specs
    }
  return Decoder(cfg, params=params, rules=rules)


def read_model_config(path: str | os.PathLike, *, dtype: Any = None) -> ModelConfig:
  """The ModelConfig of an HF model directory's config.json, without reading any weights.

  Raises:
    HFConfigError: for an unsupported model_type, config option or quantization_config.
    FileNotFoundError: when the directory holds no config.json.
  """
  return _config(paths.path(path), dtype)[0]


def _config(path: paths.Path, dtype: Any) -> tuple[ModelConfig, HFFamily, tuple[int, int] | None, dict[str, Any]]:
  """The config, family, FP8 weight block size (None: unquantised) and parsed dict of a directory's config.json."""
  where = path / "config.json"
  if not where.is_file():
    raise FileNotFoundError(f"{where}: no such file (an HF model directory holds config.json and safetensors)")
  try:
    hf = json.loads(where.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: not valid JSON ({e})") from e
  family = family_of(hf, str(where))
  cfg = model_config(hf, family, None if dtype is None else jnp.dtype(dtype).name, str(where))
  return cfg, family, fp8_blocks.block_size(hf, str(where)), hf


def _headers(path: pathlib.Path) -> dict[str, _Tensor]:
  """Checkpoint tensor name -> its description, read from the safetensors headers only."""
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
    start, header = _read_header(file)
    with _open(file):  # safetensors' own checks of the header (offsets, sizes against dtypes and shapes)
      pass
    for name, t in header.items():
      if name != "__metadata__":
        out[name] = _Tensor(name, file, tuple(t["shape"]), t["dtype"], start + t["data_offsets"][0])
  for name, file in (weight_map or {}).items():
    if name not in out or out[name].file != path / file:
      raise CheckpointError(f"{index}: names tensor {name!r} in {file}, which does not hold it")
  return out


def _read_header(file: pathlib.Path) -> tuple[int, dict[str, Any]]:
  """The first data byte and the parsed header of a safetensors file.

  Raises CheckpointError naming `file` when it is shorter than its header says.
  """
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
  return 8 + header_len, header


def _open(file: pathlib.Path) -> Any:
  """safetensors' `safe_open` of `file`, its errors raised as CheckpointError naming the file."""
  from safetensors import SafetensorError, safe_open

  try:
    return safe_open(str(file), framework="np")
  except SafetensorError as e:
    raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None


def _match(specs: dict[str, Any], cfg: ModelConfig, family: HFFamily, headers: dict[str, _Tensor],
           path: pathlib.Path, block: tuple[int, int] | None,
           skipped: tuple[str, ...] = ()) -> dict[str, list[list[_Source]]]:
  """Pairs every ptx parameter with its per-layer HF tensors (and FP8 scales); checks names and shapes.

  Tensors whose names start with a prefix of `skipped` (extra layers the decoder does not run) are left out.
  """
  found = {}
  for name, tensor in headers.items():
    canonical = name
    for old, new in family.aliases:
      if name.startswith(old):
        canonical = new + name[len(old):]
        break
    skip = name.startswith(family.ignored + skipped) or name.endswith(_SKIPPED_SUFFIXES)
    if not skip and not (cfg.tie_embeddings and canonical == family.names["lm_head"]):
      found[canonical] = tensor
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
      if found[n].shape != want:
        raise CheckpointError(f"{found[n].file}: tensor {found[n].name!r} has shape {list(found[n].shape)}, "
                              f"expected {list(want)} for ptx {key} of the config")
    pairs = [(found[n], _scale(found[n], found.get(n + fp8_blocks.SCALE_SUFFIX), block)) for n in names]
    sources[key] = [pairs[i:i + experts] for i in range(0, len(pairs), experts)]
    expected.update(names)
    expected.update(n + fp8_blocks.SCALE_SUFFIX for n, (_, scale) in zip(names, pairs) if scale is not None)
  for canonical, tensor in found.items():
    if canonical not in expected:
      raise CheckpointError(f"{tensor.file}: unexpected tensor {tensor.name!r} for {family.model_type} with this "
                            "config")
  return sources


def _scale(weight: _Tensor, scale: _Tensor | None, block: tuple[int, int] | None) -> _Tensor | None:
  """The FP8 scale grid of `weight`, checked against it; None for an unquantised weight."""
  if weight.dtype != fp8_blocks.E4M3:
    if scale is not None and block is not None:
      raise CheckpointError(f"{scale.file}: tensor {scale.name!r} scales {weight.name!r}, which is {weight.dtype}, "
                            f"not float8 ({fp8_blocks.E4M3})")
    return None  # unquantised; without a quantization_config, a scale is named as an unexpected tensor
  if block is None:
    raise CheckpointError(f"{weight.file}: tensor {weight.name!r} is float8 ({weight.dtype}), but config.json has no "
                          "quantization_config (quant_method 'fp8', weight_block_size) to say how it is scaled")
  if scale is None:
    raise CheckpointError(f"{weight.file}: float8 tensor {weight.name!r} has no scales "
                          f"{weight.name + fp8_blocks.SCALE_SUFFIX!r}")
  want = fp8_blocks.scale_shape(weight.shape, block)
  if scale.shape != want or scale.dtype not in fp8_blocks.SCALE_DTYPES:
    raise CheckpointError(f"{scale.file}: tensor {scale.name!r} is {scale.dtype} of shape {list(scale.shape)}, "
                          f"expected {' or '.join(fp8_blocks.SCALE_DTYPES)} of shape {list(want)}: the scales of "
                          f"{weight.name!r} {list(weight.shape)} in {list(block)} blocks (config.json "
                          "quantization_config weight_block_size)")
  return scale


def _load(spec: ParamSpec, leaf: str, sources: list[list[_Source]], target: jax.sharding.Sharding, dtype: np.dtype,
          block_size: tuple[int, int] | None, rows: np.ndarray | None = None) -> jax.Array:
  """Builds one parameter on its sharding, reading each distinct device block once.

  `sources[i]` lists layer i's HF tensors: one, or one per expert, of which a
  block reads only the experts it holds; each with its FP8 scales, or None.
  `rows` reorders the HF tensors' first axis (`hf_config.interleaved_rope_rows`).
  """
  stacked = spec.logical_axes[0] == "layers"
  axes, shape = (spec.logical_axes[1:], spec.shape[1:]) if stacked else (spec.logical_axes, spec.shape)
  handles: dict[pathlib.Path, Any] = {}
  blocks: dict[tuple, np.ndarray] = {}

  def tensor_slice(tensor: _Tensor) -> Any:
    if tensor.file not in handles:
      handles[tensor.file] = _open(tensor.file)
    return handles[tensor.file].get_slice(tensor.name)

  def read_tensor(source: _Source, axes, shape, block: tuple[slice, ...]) -> np.ndarray:
    weight, scale = source
    if scale is None:
      data = tensor_slice(weight)
      read = data.__getitem__
    else:
      values = functools.partial(fp8_blocks.read_e4m3, weight.file, weight.offset, weight.shape)
      scales = tensor_slice(scale)
      read = lambda index: fp8_blocks.read_slice(values, scales.__getitem__, index, block_size)
    return hf_layout.read_block(read if rows is None else _reordered(read, rows), leaf, axes, shape, block)

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


def _reordered(read: Any, rows: np.ndarray) -> Any:
  """`read` of an HF tensor whose first axis is taken in the order `rows`: reads the span the rows cover, then picks."""

  def read_rows(index: tuple[slice, ...]) -> np.ndarray:
    wanted = rows[index[0]]
    low, high = int(wanted.min()), int(wanted.max()) + 1
    return read((slice(low, high),) + tuple(index[1:]))[wanted - low]

  return read_rows


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
