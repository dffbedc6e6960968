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
a model unquantised, without a quantization_config. MXFP4 checkpoints
(quant_method "mxfp4", as gpt-oss ships its MoE experts) load the same way: a
tensor stored as `X_blocks` and `X_scales` is read in X's bf16 hub layout, each
device dequantising the experts, rows and column blocks its slice covers
(`ptx.models.mxfp4`).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from ptx import paths, sharding
from ptx.model_config import ModelConfig
from ptx.models import fp8_blocks, hf_layout, mxfp4
from ptx.models.decoder import Decoder
from ptx.models.hf_config import HFConfigError, HFFamily, family_of, interleaved_rope_rows, model_config
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


class _Quantization(NamedTuple):
  """How config.json's `quantization_config` says the quantised tensors are stored."""

  method: str  # its quant_method: "fp8" or "mxfp4"
  block: tuple[int, int] | None  # FP8's weight_block_size; None for MXFP4 (blocks of 32 along a row)


class _Source(NamedTuple):
  """An HF tensor, by its name in the hub layout, and the tensors that store it."""

  shape: tuple[int, ...]  # its hub layout's shape
  values: _Tensor  # itself, or its float8 values (FP8) or its packed FP4 `X_blocks` (MXFP4)
  scales: _Tensor | None  # FP8's `X_scale_inv` or MXFP4's `X_scales`; None: stored unquantised
  stored: tuple[str, ...]  # the (canonical) names of the tensors it is read from


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
  cfg, family, quantization, hf = _config(path, dtype)
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
    sources = _match(specs, cfg, family, _headers(local), local, quantization, skipped)
    params = {
        key: ({leaf: _load(specs[key][leaf], leaf, sources[f"{key}/{leaf}"], shardings[key][leaf], np_dtype,
                           quantization, rows.get(f"{key}/{leaf}"), family.layouts) for leaf in specs[key]}
              if isinstance(specs[key], dict) else
              _load(specs[key], key, sources[key], shardings[key], np_dtype, quantization, layouts=family.layouts))
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


def read_tensor(path: str | os.PathLike, name: str, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
  """Reads one tensor of a local HF model directory in its hub layout, dequantised as config.json says.

  Args:
    path: a local directory with `config.json` and safetensors; only its quantization_config is read.
    name: the tensor's name in the hub layout, also when it is stored quantised (FP8 `X` with `X_scale_inv`,
      MXFP4 `X_blocks` with `X_scales`).
    sharding: its placement, each device reading only its slice; None puts it on this process's first device.

  Returns:
    The tensor: float32 when it is stored quantised, else in its stored dtype.

  Raises:
    HFConfigError: for a quantization_config that ptx does not read.
    CheckpointError: when the directory does not hold the tensor, or holds its quantised form wrongly.
  """
  path = pathlib.Path(path)
  quantization = _quantization(_config_json(path), str(path / "config.json"))
  headers = _headers(path)
  if name not in headers and name + mxfp4.BLOCKS_SUFFIX not in headers:
    raise CheckpointError(f"{path}: missing tensor {name!r}")
  source, handles = _source(name, headers, quantization), {}
  read = _reader(source, quantization, handles)
  index_of = lambda index: tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, source.shape))
  if sharding is None:
    sharding = SingleDeviceSharding(jax.local_devices()[0])
  try:
    return jax.make_array_from_callback(source.shape, sharding, lambda index: read(index_of(index)))
  finally:
    handles.clear()


def _config(path: paths.Path, dtype: Any) -> tuple[ModelConfig, HFFamily, _Quantization | None, dict[str, Any]]:
  """The config, family, quantisation (None: unquantised) and parsed dict of a directory's config.json."""
  hf = _config_json(path)
  where = str(path / "config.json")
  family = family_of(hf, where)
  cfg = model_config(hf, family, None if dtype is None else jnp.dtype(dtype).name, where)
  return cfg, family, _quantization(hf, where), hf


def _config_json(path: paths.Path) -> dict[str, Any]:
  """The parsed config.json of an HF model directory."""
  where = path / "config.json"
  if not where.is_file():
    raise FileNotFoundError(f"{where}: no such file (an HF model directory holds config.json and safetensors)")
  try:
    return json.loads(where.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: not valid JSON ({e})") from e


def _quantization(hf: dict[str, Any], where: str) -> _Quantization | None:
  """How a config.json's `quantization_config` stores the quantised tensors; None when it has none.

  Raises HFConfigError naming the field for a quantisation ptx does not read.
  """
  q = hf.get("quantization_config")
  if q is None:
    return None
  method = q.get("quant_method")
  if method == "fp8":
    return _Quantization(method, fp8_blocks.block_size(q, where))
  if method == "mxfp4":  # its other fields (modules_to_not_convert) name what the tensors themselves show
    return _Quantization(method, None)
  raise HFConfigError(f"{where}: quantization_config quant_method={method!r} is not supported; ptx reads 'fp8' "
                      "(float8 weights with block scales) and 'mxfp4' (FP4 blocks with power-of-two scales)")


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
           path: pathlib.Path, quantization: _Quantization | None,
           skipped: tuple[str, ...] = ()) -> dict[str, list[list[_Source]]]:
  """Pairs every ptx parameter with its per-layer HF tensors (and their quantised forms); checks names and shapes.

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
    experts = shape[0] if hf_layout.per_expert(leaf, axes, family.layouts) else 1
    if hf_layout.per_expert(leaf, axes, family.layouts):  # one HF tensor per expert
      axes, shape = axes[1:], shape[1:]
    want = hf_layout.hf_shape(leaf, axes, shape, family.layouts)
    layers = cfg.stack_layers(key.split("/")[0]) if stacked else (0,)
    names = [family.names[key].format(i=i, e=e) for i in layers for e in range(experts)]
    missing = [n for n in names if n not in found and n + mxfp4.BLOCKS_SUFFIX not in found]
    if missing:
      raise CheckpointError(f"{path}: missing tensor {missing[0]!r} (ptx {key}; {len(missing)} missing for it)")
    layer_sources = [_source(n, found, quantization) for n in names]
    for source in layer_sources:
      if hf_layout.flattened(leaf, source.shape) != want:
        packed = "" if source.shape == source.values.shape else f" (MXFP4 blocks of {list(source.shape)})"
        raise CheckpointError(f"{source.values.file}: tensor {source.values.name!r} has shape "
                              f"{list(source.values.shape)}{packed}, expected {list(want)} for ptx {key} of the config")
    sources[key] = [layer_sources[i:i + experts] for i in range(0, len(layer_sources), experts)]
    expected.update(stored for source in layer_sources for stored in source.stored)
  for canonical, tensor in found.items():
    if canonical not in expected:
      raise CheckpointError(f"{tensor.file}: unexpected tensor {tensor.name!r} for {family.model_type} with this "
                            "config")
  return sources


def _source(name: str, found: dict[str, _Tensor], quantization: _Quantization | None) -> _Source:
  """How HF tensor `name` (canonical, in `found` itself or as MXFP4 blocks) is stored, its scales checked."""
  if name not in found:
    return _mxfp4_source(name, found[name + mxfp4.BLOCKS_SUFFIX], found.get(name + mxfp4.SCALES_SUFFIX), quantization)
  weight = found[name]
  scale = _fp8_scale(weight, found.get(name + fp8_blocks.SCALE_SUFFIX), quantization)
  stored = (name,) if scale is None else (name, name + fp8_blocks.SCALE_SUFFIX)
  return _Source(weight.shape, weight, scale, stored)


def _mxfp4_source(name: str, blocks: _Tensor, scales: _Tensor | None, quantization: _Quantization | None) -> _Source:
  """The MXFP4 `X_blocks` and `X_scales` of HF tensor `name`, checked against each other."""
  if quantization is None or quantization.method != "mxfp4":
    raise CheckpointError(f"{blocks.file}: tensor {blocks.name!r} holds {name!r} in MXFP4 blocks, but config.json has "
                          f"{_described(quantization)}: quantization_config quant_method 'mxfp4' says how they are "
                          "stored")
  if scales is None:
    raise CheckpointError(f"{blocks.file}: MXFP4 tensor {blocks.name!r} has no scales {name + mxfp4.SCALES_SUFFIX!r}")
  shape = mxfp4.hub_shape(blocks.shape)
  if blocks.dtype != mxfp4.PACKED_DTYPE or shape is None:
    raise CheckpointError(f"{blocks.file}: tensor {blocks.name!r} is {blocks.dtype} of shape {list(blocks.shape)}, "
                          f"expected {mxfp4.PACKED_DTYPE} of shape [experts, rows, columns / {mxfp4.BLOCK}, "
                          f"{mxfp4.BLOCK_BYTES}] (config.json quantization_config quant_method 'mxfp4')")
  if scales.dtype != mxfp4.PACKED_DTYPE or scales.shape != blocks.shape[:-1]:
    raise CheckpointError(f"{scales.file}: tensor {scales.name!r} is {scales.dtype} of shape {list(scales.shape)}, "
                          f"expected {mxfp4.PACKED_DTYPE} of shape {list(blocks.shape[:-1])}: a scale per block of "
                          f"{blocks.name!r} {list(blocks.shape)}")
  return _Source(shape, blocks, scales, (name + mxfp4.BLOCKS_SUFFIX, name + mxfp4.SCALES_SUFFIX))


def _fp8_scale(weight: _Tensor, scale: _Tensor | None, quantization: _Quantization | None) -> _Tensor | None:
  """The FP8 scale grid of `weight`, checked against it; None for an unquantised weight."""
  block = quantization.block if quantization is not None else None
  if weight.dtype != fp8_blocks.E4M3:
    if scale is not None and block is not None:
      raise CheckpointError(f"{scale.file}: tensor {scale.name!r} scales {weight.name!r}, which is {weight.dtype}, "
                            f"not float8 ({fp8_blocks.E4M3})")
    return None  # unquantised; a scale without an FP8 quantization_config is named as an unexpected tensor
  if block is None:
    raise CheckpointError(f"{weight.file}: tensor {weight.name!r} is float8 ({weight.dtype}), but config.json has "
                          f"{_described(quantization)}: quantization_config quant_method 'fp8' with a "
                          "weight_block_size says how it is scaled")
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


def _described(quantization: _Quantization | None) -> str:
  """config.json's quantisation, as an error message names it."""
  return "no quantization_config" if quantization is None else f"quant_method {quantization.method!r}"


def _load(spec: ParamSpec, leaf: str, sources: list[list[_Source]], target: jax.sharding.Sharding, dtype: np.dtype,
          quantization: _Quantization | None, rows: np.ndarray | None = None,
          layouts: Mapping[str, hf_layout.Layout] = hf_layout.HF_LAYOUTS) -> jax.Array:
  """Builds one parameter on its sharding, reading each distinct device block once.

  `sources[i]` lists layer i's HF tensors: one, or one per expert, of which a
  block reads only the experts it holds; each as stored or quantised.
  `rows` reorders the HF tensors' first axis (`hf_config.interleaved_rope_rows`); `layouts` is the family's.
  """
  stacked = spec.logical_axes[0] == "layers"
  axes, shape = (spec.logical_axes[1:], spec.shape[1:]) if stacked else (spec.logical_axes, spec.shape)
  handles: dict[pathlib.Path, Any] = {}
  blocks: dict[tuple, np.ndarray] = {}

  def read_tensor(source: _Source, axes, shape, block: tuple[slice, ...]) -> np.ndarray:
    read = _reader(source, quantization, handles)
    if leaf in hf_layout.CONV_KERNELS:
      read = _flattened_kernel(read)
    return hf_layout.read_block(read if rows is None else _reordered(read, rows), leaf, axes, shape, block, layouts)

  def read_layer(i: int, block: tuple[slice, ...]) -> np.ndarray:
    if not hf_layout.per_expert(leaf, axes, layouts):
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


def _reader(source: _Source, quantization: _Quantization | None,
            handles: dict[pathlib.Path, Any]) -> Callable[[tuple[slice, ...]], np.ndarray]:
  """The function that reads a slice of an HF tensor in its hub layout: as stored, or dequantised to float32.

  `handles` keeps the files it opens (one `_open` a file), for the caller to close.
  """

  def tensor_slice(tensor: _Tensor) -> Any:
    if tensor.file not in handles:
      handles[tensor.file] = _open(tensor.file)
    return handles[tensor.file].get_slice(tensor.name)

  if source.scales is None:
    return tensor_slice(source.values).__getitem__
  scales = tensor_slice(source.scales).__getitem__
  if quantization.method == "mxfp4":
    return functools.partial(mxfp4.read_slice, tensor_slice(source.values).__getitem__, scales)
  values = functools.partial(fp8_blocks.read_e4m3, source.values.file, source.values.offset, source.values.shape)
  return lambda index: fp8_blocks.read_slice(values, scales, index, quantization.block)


def _flattened_kernel(read: Any) -> Any:
  """`read` of a convolution kernel [out, in, kernel...] seen as [out, in x kernel...] (`hf_layout.CONV_KERNELS`).

  Reads the output rows asked for with every trailing axis whole, flattens those, then cuts the columns asked for.
  """

  def read_rows(index: tuple[slice, ...]) -> np.ndarray:
    rows = read((index[0],))
    return rows.reshape(rows.shape[0], -1)[:, index[1]]

  return read_rows


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
