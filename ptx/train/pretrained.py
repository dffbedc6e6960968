"""A job's config, starting weights and tokenizer: from a preset and overrides, or from an HF checkpoint.

`from_pretrained(model_dir, cfg)` is the Python start of a fine-tune, and
`configure(base, overrides, model_dir=...)` is the one place the CLI and
the recipes turn their flags into what a job starts from (through it). With a model
directory the architecture comes from its config.json and the execution
settings (`ptx.model_config.EXECUTION_FIELDS`: dtypes, remat, attention, logits
chunk, scan) stay as the preset and the command line chose them; an
explicit `--model.n_layers` below the checkpoint's keeps its first layers
(smoke runs of a real model), and any other architecture override that
contradicts the checkpoint is an error naming the field. The tokenizer is
the one that comes with the weights (or `--data.tokenizer`), and it must
fit the model's vocabulary (`ptx.data.tokenizer.check_fits`). A `.gguf`
file is converted once into OUT/pretrained first. Model directories and
OUT are local or gs:// (`ptx.paths`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

from ptx import model_config
from ptx import paths
from ptx import config_io
from ptx.config import Config, ConfigError
from ptx.data.hf_tokenizer import load_tokenizer
from ptx.data.tokenizer import ByteTokenizer, Tokenizer, check_fits
from ptx.models.hf_load import load_hf, read_model_config
from ptx.models.params import first_layers
from ptx.sharding import make_mesh, rules_of


class Pretrained(NamedTuple):
  """What a job starts from: its config (the checkpoint's architecture), the weights and the tokenizer."""

  cfg: Config
  params: Any
  tokenizer: Tokenizer


def from_pretrained(model_dir: str | os.PathLike, cfg: Config, *, n_layers: int | None = None,
                    out: str | os.PathLike | None = None) -> Pretrained:
  """`cfg` with the architecture of an HF checkpoint, its weights and its tokenizer: the Python start of a fine-tune.

  Every architecture field of `cfg.model` is replaced by the checkpoint's
  (config.json); its execution settings (`ptx.model_config.EXECUTION_FIELDS`)
  and every other section stay as given, so `ptx.FINETUNE["grpo"]()` or a
  config of your own is the base. The tokenizer is the checkpoint's, unless
  `cfg.data.tokenizer` names another.

      start = ptx.from_pretrained("out/smollm2", ptx.FINETUNE["grpo"]())
      ptx.train_grpo(start.cfg, tasks=tasks, rewards=fn, tokenizer=start.tokenizer, out="out/grpo",
                     init_params=start.params)

  Args:
    model_dir: an HF model directory (config.json, safetensors, tokenizer), local or gs://, or a `.gguf` file.
    cfg: the job's config; its model architecture is replaced.
    n_layers: keep only the first this many layers (a smoke run of a big model); None keeps them all.
    out: the run directory, where a `.gguf` file is converted (OUT/pretrained, once).

  Returns:
    Pretrained(cfg, params, tokenizer).

  Raises:
    ValueError: n_layers outside 1 .. the checkpoint's layers; a tokenizer with more tokens than the model's
      vocabulary.
    OSError: an unreadable checkpoint or tokenizer, naming the file.
  """
  model_dir = _hf_directory(paths.path(model_dir), None if out is None else paths.path(out))
  checkpoint = read_model_config(model_dir)
  model = model_config.with_architecture(cfg.model, checkpoint)
  if n_layers is not None:
    if not 1 <= n_layers <= checkpoint.n_layers:
      raise ValueError(f"n_layers={n_layers}: {model_dir / 'config.json'} has {checkpoint.n_layers} layers, and a "
                       f"smoke run keeps 1 to {checkpoint.n_layers} of them")
    model = dataclasses.replace(model, n_layers=n_layers)
  data = cfg.data if cfg.data.tokenizer != "byte" else dataclasses.replace(cfg.data, tokenizer=str(model_dir))
  cfg = dataclasses.replace(cfg, model=model, data=data)
  tokenizer = load_tokenizer(cfg.data.tokenizer)
  # Before the weights load: the job builders check again, but only once they are in memory.
  check_fits(tokenizer, cfg.model.vocab_size, f"the tokenizer of {cfg.data.tokenizer} with {model_dir / 'config.json'}")
  params = load_hf(model_dir, mesh=make_mesh(cfg.mesh), dtype=cfg.model.param_dtype, rules=rules_of(cfg.mesh)).params
  if cfg.model.n_layers < checkpoint.n_layers:
    params = first_layers(params, cfg.model)
  return Pretrained(cfg, params, tokenizer)


def configure(base: Config, overrides: list[str], *, model_dir: str | os.PathLike | None = None,
              out: str | os.PathLike | None = None) -> Pretrained:
  """The run's config, starting parameters (None: a fresh init) and tokenizer, from command-line overrides.

  Args:
    base: the preset the run starts from.
    overrides: `--section.field=value` words, applied in order.
    model_dir: an HF model directory (config.json, safetensors, tokenizer),
      or a `.gguf` file; None trains a fresh model.
    out: the run directory (a `.gguf` file is converted into OUT/pretrained).

  Raises:
    ConfigError: for a bad override, or one that contradicts the checkpoint.
    OSError, ValueError: for an unreadable checkpoint or tokenizer (naming the file), or a tokenizer with more
      tokens than model.vocab_size.
  """
  cfg = config_io.apply_overrides(base, overrides)
  if model_dir is None:
    tokenizer = ByteTokenizer() if cfg.data.tokenizer == "byte" else load_tokenizer(cfg.data.tokenizer)
    return Pretrained(cfg, None, tokenizer)  # the job builders check that it fits model.vocab_size
  if any(arg.split("=", 1)[0] == "--model" for arg in overrides):
    raise ConfigError("--model=PRESET and --model-dir both choose the architecture: give one")
  hf_dir = _hf_directory(paths.path(model_dir), None if out is None else paths.path(out))
  checkpoint = read_model_config(hf_dir)
  chosen = dataclasses.replace(cfg, model=model_config.with_architecture(cfg.model, checkpoint))
  chosen = config_io.apply_overrides(chosen, [arg for arg in overrides if arg.startswith("--model.")])
  for name in model_config.architecture_differences(chosen.model, checkpoint):
    if name != "n_layers" or chosen.model.n_layers > checkpoint.n_layers:
      raise ConfigError(f"--model.{name}={getattr(chosen.model, name)!r} contradicts {hf_dir / 'config.json'} "
                        f"({name}={getattr(checkpoint, name)!r}); only model.n_layers may be lowered (a smoke run "
                        "keeps the first layers)")
  return from_pretrained(hf_dir, cfg, n_layers=chosen.model.n_layers)


def hf_directory(path: paths.Path, out: paths.Path) -> paths.Path:
  """The HF directory a start names: `path` itself, or for a `.gguf` file OUT/pretrained, its conversion."""
  return out / "pretrained" if path.suffix == ".gguf" else path


def _hf_directory(path: paths.Path, out: paths.Path | None) -> paths.Path:
  """`path`, or for a `.gguf` file the HF directory it converts to under OUT/pretrained (once)."""
  if path.suffix != ".gguf":
    return path
  if out is None:
    raise ConfigError(f"{path}: a GGUF file is converted into the run directory; give the run's out directory")
  target = hf_directory(path, out)
  if not (target / "config.json").exists():
    from ptx.models.gguf import convert_gguf  # the gguf extra; only a .gguf start needs it

    convert_gguf(path, target, dtype="float32")
    print(f"converted {path} into {target} (float32)", flush=True)
  return target
