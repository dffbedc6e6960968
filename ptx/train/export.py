"""Exporting a trained state: merged weights as an HF directory, adapters in the PEFT layout.

`export_hf(state, cfg, out, tokenizer)` writes `out/hf` (config.json,
generation_config.json, safetensors and the tokenizer files with its chat
template, loadable by `transformers`, `ptx eval` and `ptx.models.load_hf`);
under LoRA the adapters are merged into the base for it, and also written
alone to `out/adapter` for `peft`. The special-token ids are the
tokenizer's (the ones ptx's sampler stops on) after what the starting
checkpoint declared, and the context length is the checkpoint's
(`ptx.models.hf_generation`), so transformers' `generate` stops where ptx
does. Parameters
with a non-finite value are never written: `NonFiniteParams` names them.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from ptx import paths
from ptx.config import Config
from ptx.data.tokenizer import Tokenizer
from ptx.models import lora as lora_lib
from ptx.models.decoder import Decoder
from ptx.models.hf_generation import GenerationInfo, read_generation, with_tokenizer
from ptx.models.hf_save import save_hf
from ptx.models.peft_export import save_peft
from ptx.train import pretrained
from ptx.train.state import TrainState


class NonFiniteParams(ValueError):
  """The parameters to export hold NaN or infinity."""


def export_hf(state: TrainState, cfg: Config, out: str | os.PathLike, tokenizer: Tokenizer | None = None, *,
              base_model: str | None = None) -> dict[str, paths.Path]:
  """Writes the state's model to `out/hf` (and its LoRA adapters to `out/adapter`).

  Args:
    state: the trained state; under LoRA (`cfg.lora.rank > 0`) `state.params`
      are the adapters and `state.base` the frozen model.
    cfg: the job config.
    out: the run directory (local or gs://, `ptx.paths`).
    tokenizer: written next to the weights when it has `save_hf(dir)` (the
      byte tokenizer and HF tokenizers do).
    base_model: the HF directory (or hub name) the weights started from:
      a local directory's special-token ids, context length and sampling
      defaults are carried into the export; a `.gguf` file stands for the
      directory `ptx.train.pretrained` converted it into, `out/pretrained`.
      Under LoRA it is recorded in adapter_config.json; None writes the base
      to `out/base` so that the adapter has one to load onto.

  Returns:
    {"hf": dir}, plus {"adapter": dir} (and {"base": dir}) under LoRA.

  Raises:
    NonFiniteParams: a parameter holds NaN or infinity; nothing is written.
  """
  _check_finite(state.params if cfg.lora.rank == 0 else {"adapters": state.params, "base": state.base})
  written = {}
  params = state.params
  out = paths.path(out)
  if base_model is not None:
    base_model = str(pretrained.hf_directory(paths.path(base_model), out))  # a .gguf start: its conversion
  declared = base_model is not None and (paths.path(base_model) / "config.json").is_file()
  # A hub name or a fresh model declares none.
  generation = read_generation(base_model) if declared else GenerationInfo()
  if tokenizer is not None:
    generation = with_tokenizer(generation, tokenizer)
  if cfg.lora.rank > 0:
    if base_model is None:
      written["base"] = _save(state.base, cfg, out / "base", tokenizer, generation)
      base_model = str(written["base"])
    written["adapter"] = save_peft(state.params, out / "adapter", model=cfg.model, lora=cfg.lora,
                                   base_model_name_or_path=base_model)
    params = lora_lib.merge(state.base, state.params, cfg.lora)
  written["hf"] = _save(params, cfg, out / "hf", tokenizer, generation)
  return written


def _save(params, cfg: Config, path: paths.Path, tokenizer: Tokenizer | None,
          generation: GenerationInfo) -> paths.Path:
  """One HF directory: weights, config and generation config, and the tokenizer when it can write itself."""
  save_hf(Decoder(cfg.model, params=params), path, generation=generation)
  if tokenizer is not None and hasattr(tokenizer, "save_hf") and jax.process_index() == 0:
    tokenizer.save_hf(path)
  return path


@jax.jit
def _finite(leaves: list[jax.Array]) -> list[jax.Array]:
  return [jnp.isfinite(x).all() for x in leaves]


def _check_finite(params) -> None:
  leaves = jax.tree_util.tree_leaves_with_path(params)
  finite = jax.device_get(_finite([x for _, x in leaves]))
  bad = [jax.tree_util.keystr(path) for (path, _), ok in zip(leaves, finite) if not ok]
  if bad:
    raise NonFiniteParams(f"not exporting: {len(bad)} parameter array(s) hold NaN or infinity "
                          f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
