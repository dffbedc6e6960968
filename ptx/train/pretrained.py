"""A job's config, starting weights and tokenizer: from a preset and overrides, or from an HF checkpoint.

`configure(base, overrides, model_dir=...)` is the one place the CLI and
the recipes turn their flags into what a job starts from. With a model
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
from typing import Any

import jax

from ptx import model_config
from ptx import paths
from ptx import config_io
from ptx.config import Config, ConfigError
from ptx.data.hf_tokenizer import load_tokenizer
from ptx.data.tokenizer import ByteTokenizer, Tokenizer, check_fits
from ptx.models.hf_load import load_hf, read_model_config
from ptx.sharding import make_mesh, rules_of


def configure(base: Config, overrides: list[str], *, model_dir: str | os.PathLike | None = None,
              out: str | os.PathLike | None = None) -> tuple[Config, Any, Tokenizer]:
  """The run's config, starting parameters (None: a fresh init) and tokenizer.

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
    return cfg, None, tokenizer  # the job builders check that it fits model.vocab_size
  if any(arg.split("=", 1)[0] == "--model" for arg in overrides):
    raise ConfigError("--model=PRESET and --model-dir both choose the architecture: give one")
  model_dir = _hf_directory(paths.path(model_dir), None if out is None else paths.path(out))
  checkpoint = read_model_config(model_dir)
  model = model_config.with_architecture(cfg.model, checkpoint)
  tokenizer_dir = str(model_dir) if cfg.data.tokenizer == "byte" else cfg.data.tokenizer
  cfg = dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, tokenizer=tokenizer_dir))
  cfg = config_io.apply_overrides(cfg, [arg for arg in overrides if arg.startswith("--model.")])
  for name in model_config.architecture_differences(cfg.model, checkpoint):
    if name != "n_layers" or cfg.model.n_layers > checkpoint.n_layers:
      raise ConfigError(f"--model.{name}={getattr(cfg.model, name)!r} contradicts {model_dir / 'config.json'} "
                        f"({name}={getattr(checkpoint, name)!r}); only model.n_layers may be lowered (a smoke run "
                        "keeps the first layers)")
  tokenizer = load_tokenizer(cfg.data.tokenizer)
  # Before the weights load: the job builders check again, but only once they are in memory.
  check_fits(tokenizer, cfg.model.vocab_size, f"the tokenizer of {cfg.data.tokenizer} with {model_dir / 'config.json'}")
  params = load_hf(model_dir, mesh=make_mesh(cfg.mesh), dtype=cfg.model.param_dtype, rules=rules_of(cfg.mesh)).params
  if cfg.model.n_layers < checkpoint.n_layers:
    params = {**params, "layers": jax.tree.map(lambda x: x[:cfg.model.n_layers], params["layers"])}
  return cfg, params, tokenizer


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
