"""Writing LoRA adapters alone in the Hugging Face PEFT layout.

`save_peft` writes `adapter_config.json` and `adapter_model.safetensors`,
which `peft.PeftModel.from_pretrained(transformers_model, path)` loads onto
the base model. PEFT names the tensors after the adapted module,
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, and stores
them as `nn.Linear` weights: lora_A [r, in] and lora_B [out, r], in and out
flattened in the order of the base weight's HF layout
(`ptx.models.hf_layout`). The merged model goes through `save_hf` instead:
`save_hf(Decoder(cfg, params=lora.merge(base, adapters, lora_cfg)), path)`.
"""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from ptx import paths
from ptx.config import LoRAConfig
from ptx.model_config import ModelConfig
from ptx.models.hf_config import FAMILIES
from ptx.models.hf_layout import HF_LAYOUTS
from ptx.models.hf_save import infer_model_type, save_safetensors
from ptx.models.lora import adapter_specs
from ptx.models.params import Params


def save_peft(adapters: Params, path: str | os.PathLike, *, model: ModelConfig, lora: LoRAConfig,
              model_type: str | None = None, base_model_name_or_path: str | None = None) -> paths.Path:
  """Writes `adapters` as a PEFT LoRA adapter directory.

  Args:
    adapters: `{target: {"a", "b"}}` (ptx.models.lora).
    path: the directory, local or gs://; created if needed.
    model: the base model's config.
    lora: the adapters' LoRA config (rank, alpha, dropout, targets).
    model_type: the HF family of the base (None infers it from `model`).
    base_model_name_or_path: recorded in adapter_config.json for PEFT's
      `AutoPeftModel` (e.g. the HF directory of the base).

  Returns:
    The directory.
  """
  family = FAMILIES[model_type or infer_model_type(model)]
  specs = adapter_specs(model, lora)
  writer = jax.process_index() == 0
  tensors, modules = {}, []
  for name in lora.targets:
    weight_name = family.names[f"layers/{name}"]  # model.layers.{i}.self_attn.q_proj.weight
    modules.append(weight_name.split(".")[-2])
    out_group, in_group = HF_LAYOUTS[name]
    layouts = {"a": (("lora_rank",), in_group), "b": (out_group, ("lora_rank",))}
    for part, peft_part in (("a", "lora_A"), ("b", "lora_B")):
      array = adapters[name][part]
      host = np.asarray(array) if array.is_fully_addressable else multihost_utils.process_allgather(array, tiled=True)
      axes = specs[name][part].logical_axes[1:]
      for i in range(model.n_layers):
        key = "base_model.model." + weight_name.format(i=i).removesuffix(".weight") + f".{peft_part}.weight"
        tensors[key] = _to_linear(host[i], axes, layouts[part])
  path = paths.path(path)
  if not writer:
    return path
  path.mkdir(parents=True, exist_ok=True)
  save_safetensors(tensors, path / "adapter_model.safetensors")
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
      "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules,
      "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
  }
  (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
  return path


def _to_linear(x: np.ndarray, axes: tuple[str, ...], layout: tuple[tuple[str, ...], ...]) -> np.ndarray:
  """One layer of an adapter (logical `axes`) as a 2-D [out, in] tensor, each side grouped per `layout`."""
  order = [a for group in layout for a in group]
  sizes = dict(zip(axes, x.shape))
  shape = [math.prod(sizes[a] for a in group) for group in layout]
  return np.ascontiguousarray(x.transpose([axes.index(a) for a in order]).reshape(shape)).astype(np.float32)
