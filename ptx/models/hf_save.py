"""Writing a ptx model as an HF directory that `transformers` loads.

`save_hf` writes `config.json`, `generation_config.json` (special-token ids
and context length, `ptx.models.hf_generation`) and the weights in HF names
and layouts, as `model.safetensors` or, above `max_shard_bytes`, as numbered
shards plus `model.safetensors.index.json`, every file readable by all.
Parameters are fetched one at a time and files are written as they fill, so
host memory holds one parameter and one shard at most. On multi-host runs every process takes part in gathering and
process 0 writes. The directory is local or gs:// (`ptx.paths`); each file
on object storage is one upload, complete once its name appears.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from ptx import paths
from ptx.model_config import ModelConfig
from ptx.models import hf_layout
from ptx.models.decoder import Decoder
from ptx.models.hf_config import FAMILIES, HFConfigError, HFFamily, hf_config, interleaved_rope_rows
from ptx.models.hf_generation import GenerationInfo
from ptx.models.params import param_specs

DEFAULT_SHARD_BYTES = 5 * 2**30


def save_hf(model: Decoder, path: str | os.PathLike, *, model_type: str | None = None,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES,
            generation: GenerationInfo = GenerationInfo()) -> paths.Path:
  """Writes `model` as an HF checkpoint directory.

  Args:
    model: the ptx Decoder (its config picks the family unless `model_type`).
    path: the directory, local or gs://; created if needed.
    model_type: the HF family to write as (e.g. "qwen2"); None infers it
      from the config's features.
    max_shard_bytes: split the weights into shards of at most this size.
    generation: the special-token ids and context length to declare (see
      `hf_generation.read_generation` and `with_tokenizer`); what it leaves
      None, transformers takes from the family's defaults.

  Returns:
    The directory.

  Raises:
    HFConfigError: for an unknown model_type, or one that cannot express the
      model's config.
  """
  cfg = model.cfg
  model_type = model_type or infer_model_type(cfg)
  writable = sorted(name for name, f in FAMILIES.items() if not f.nested)
  if model_type not in writable:
    raise HFConfigError(f"save_hf writes model_type {writable}, not {model_type!r}")
  family = FAMILIES[model_type]
  config = hf_config(cfg, family)
  path = paths.path(path)
  writer = jax.process_index() == 0
  if writer:
    path.mkdir(parents=True, exist_ok=True)
  params = model.params
  tensors = _hf_tensors(params, cfg, family, writer)
  if writer:
    write_tensors(tensors, path, max_shard_bytes)
    write_configs(config, generation, path)
  else:
    for _ in tensors:  # every process joins each gather
      pass
  return path


def check_exportable(cfg: ModelConfig) -> None:
  """Raises HFConfigError, naming the field, when no HF family can express `cfg` (before a run that exports)."""
  hf_config(cfg, FAMILIES[infer_model_type(cfg)])


def infer_model_type(cfg: ModelConfig) -> str:
  """The HF model_type whose architecture has exactly the config's features."""
  if cfg.mla.enabled:
    return "deepseek_v3"
  if cfg.attention_sinks:
    return "gpt_oss"
  if cfg.moe.enabled:
    return "qwen3_moe" if cfg.qk_norm else "mixtral"
  if cfg.post_norms:
    return "gemma3_text" if cfg.qk_norm else "gemma2"
  if cfg.qk_norm:
    return "qwen3"
  return "qwen2" if cfg.qkv_bias else "llama"


def write_configs(config: dict, generation: GenerationInfo, path: paths.Path) -> None:
  """Writes config.json and generation_config.json into directory `path`.

  Args:
    config: the config.json dict of the architecture (`hf_config`).
    generation: the special-token ids and context length, added to
      config.json and written as generation_config.json.
    path: an existing directory.
  """
  (path / "config.json").write_text(json.dumps({**config, **generation.config_keys()}, indent=2) + "\n")
  (path / "generation_config.json").write_text(json.dumps(generation.generation_config(), indent=2) + "\n")


def write_tensors(tensors: Iterable[tuple[str, np.ndarray]], path: paths.Path, max_shard_bytes: int) -> None:
  """Writes named HF tensors as safetensors, sharded with an index above `max_shard_bytes`."""
  # A previous save's weights would shadow or mix with these ones.
  for stale in [*path.glob("model*.safetensors"), *path.glob("model.safetensors.index.json")]:
    stale.unlink()
  files: list[dict[str, np.ndarray]] = []  # tensor names per written shard
  shard: dict[str, np.ndarray] = {}
  size = total = 0
  for name, array in tensors:
    if shard and size + array.nbytes > max_shard_bytes:
      save_safetensors(shard, path / f"part-{len(files)}.safetensors")
      files.append(list(shard))
      shard, size = {}, 0
    shard[name] = array
    size += array.nbytes
    total += array.nbytes
  if not files:
    save_safetensors(shard, path / "model.safetensors")
    return
  save_safetensors(shard, path / f"part-{len(files)}.safetensors")
  files.append(list(shard))
  # Final names carry the shard count, known only once all are written; on object storage a rename is a
  # server-side copy and a delete, so a final name still appears only once its object is whole.
  weight_map = {}
  for i, names in enumerate(files):
    final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
    (path / f"part-{i}.safetensors").rename(path / final)
    weight_map.update(dict.fromkeys(names, final))
  index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
  (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def save_safetensors(tensors: dict[str, np.ndarray], file: paths.Path) -> None:
  """Writes one safetensors file, readable like the JSON files next to it.

  Args:
    tensors: name -> array.
    file: the file to write (replaced if it exists), local or on object
      storage (written locally first, then uploaded whole).
  """
  from safetensors.numpy import save_file

  with paths.local_file(file) as name:
    save_file(tensors, name, metadata={"format": "pt"})
    # safetensors writes through a private temporary file (mode 0600); a shared model directory must be readable.
    os.chmod(name, 0o644)


def _hf_tensors(params: dict, cfg: ModelConfig, family: HFFamily, writer: bool) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (HF name, array) per layer and parameter, fetching one parameter at a time.

  A tensor that fuses several parameters (`hf_layout.Part`: gpt-oss's gate_up_proj) is yielded once its last part is
  written into it, so host memory then holds the earlier parts' tensors as well.
  """
  specs = param_specs(cfg)
  rows = interleaved_rope_rows({}, family, cfg)  # save_hf writes rope_interleave=true where the family has it
  fused: dict[str, tuple[np.ndarray, int]] = {}  # HF name -> (the tensor, parts written into it)

  def tensor(name: str, x: np.ndarray, leaf: str, axes: tuple[str, ...]) -> Iterator[tuple[str, np.ndarray]]:
    """HF tensor `name` of one layer's `x`, or nothing yet while a fused tensor waits for its other parts."""
    parts = [a.count for group in family.layouts[leaf] for a in group if isinstance(a, hf_layout.Part)]
    if not parts:
      yield name, hf_layout.to_hf(x, leaf, axes, family.layouts)
      return
    into, written = fused.pop(name, (None, 0))
    into = hf_layout.to_hf(x, leaf, axes, family.layouts, into=into)
    if written + 1 == parts[0]:
      yield name, into
    else:
      fused[name] = (into, written + 1)

  for key, value in specs.items():
    for leaf, spec in (value.items() if isinstance(value, dict) else [(key, value)]):
      array = params[key][leaf] if isinstance(value, dict) else params[key]
      host = np.asarray(array) if array.is_fully_addressable else multihost_utils.process_allgather(array, tiled=True)
      if not writer:
        yield "", host
        continue
      path = f"{key}/{leaf}" if isinstance(value, dict) else key
      if spec.logical_axes[0] != "layers":
        yield from tensor(family.names[path], host, leaf, spec.logical_axes)
        continue
      layers = cfg.stack_layers(key)  # the stack's position j holds layer layers[j]
      axes = spec.logical_axes[1:]
      if hf_layout.per_expert(leaf, axes, family.layouts):  # one HF tensor per layer and expert
        for j, e in np.ndindex(*host.shape[:2]):
          yield from tensor(family.names[path].format(i=layers[j], e=e), host[j, e], leaf, axes[1:])
      elif path in rows:  # the checkpoint's row rows[r] holds ptx's row r
        for j, i in enumerate(layers):
          hf = hf_layout.to_hf(host[j], leaf, axes, family.layouts)
          yield family.names[path].format(i=i), hf[np.argsort(rows[path])]
      else:
        for j, i in enumerate(layers):
          yield from tensor(family.names[path].format(i=i), host[j], leaf, axes)
