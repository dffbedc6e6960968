"""What every recipe shares: its flags, multi-host start-up, its config, starting weights and export.

A recipe is a `PRESETS` table of configs plus a short `main`. `parse` reads
the common flags (`--preset`, `--out`, `--model-dir`, `--resume`, the
multi-host ones) and leaves `--section.field=value` overrides to `configure`.
On a pod every host runs the same command with `--distributed`; `start`
initialises `jax.distributed` before any JAX computation. Recipes import this
module as `launch` (a script's own folder is first on `sys.path`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
from typing import Any, Callable

import jax

import ptx
from ptx import config as config_lib
from ptx.data.hf_tokenizer import load_tokenizer

Presets = dict[str, Callable[[], ptx.Config]]
# What transformers reads to rebuild the tokenizer and its chat template.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json", "generation_config.json")


def parse(doc: str, presets: Presets, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
  """Parses the common recipe flags; returns (flags, config overrides)."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0], epilog="Config overrides: --train.steps=2, "
                                   "--mesh.fsdp=8, --data.train_files='[\"a.jsonl\"]', ...")
  parser.add_argument("--preset", choices=sorted(presets), default="tiny", help="the recipe's configuration")
  parser.add_argument("--out", type=pathlib.Path, required=True, help="run directory (checkpoints, metrics, export)")
  parser.add_argument("--model-dir", type=pathlib.Path, help="HF model directory to start from (weights, tokenizer)")
  parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  parser.add_argument("--distributed", action="store_true", help="jax.distributed.initialize() (TPU pods, SLURM)")
  args, overrides = parser.parse_known_args(argv)
  args.error = parser.error
  return args, overrides


def start(args: argparse.Namespace) -> None:
  """Process-wide JAX settings and, with --distributed, the multi-host runtime."""
  # Pinned so RNG streams do not change when JAX's default does (STYLE 17).
  jax.config.update("jax_threefry_partitionable", True)
  if args.distributed:
    jax.distributed.initialize()


def configure(args: argparse.Namespace, base: ptx.Config, overrides: list[str]) -> tuple[ptx.Config, Any, Any]:
  """The run's config, starting parameters (None: fresh init) and tokenizer.

  With --model-dir the model config comes from its config.json, and the
  weights are loaded straight into their shardings on the run's mesh;
  `--model.*` overrides (remat, attention_impl) apply on top, and a smaller
  `--model.n_layers` keeps the first layers (smoke runs of a real model).
  """
  try:
    cfg = config_lib.apply_overrides(base, overrides)
    if args.model_dir is None:
      tokenizer = ptx.ByteTokenizer() if cfg.data.tokenizer == "byte" else load_tokenizer(cfg.data.tokenizer)
      return cfg, None, tokenizer
    model = ptx.load_hf(args.model_dir, mesh=ptx.make_mesh(cfg.mesh), dtype=cfg.model.param_dtype)
    cfg = config_lib.apply_overrides(dataclasses.replace(base, model=model.cfg), overrides)
    params = model.params
    if cfg.model.n_layers < model.cfg.n_layers:  # a smoke run keeps the first layers of the real model
      params = {**params, "layers": jax.tree.map(lambda x: x[:cfg.model.n_layers], params["layers"])}
    return cfg, params, load_tokenizer(args.model_dir)
  except (config_lib.ConfigError, OSError, ValueError) as e:
    args.error(str(e))


def export(cfg: ptx.Config, state: ptx.TrainState, args: argparse.Namespace) -> pathlib.Path:
  """Writes the trained model to OUT/hf: an HF directory (under LoRA, PEFT adapters) with the tokenizer."""
  out = args.out / "hf"
  if cfg.lora.rank > 0:
    from ptx.models.peft_export import save_peft

    save_peft(state.params, out, model=cfg.model, lora=cfg.lora,
              base_model_name_or_path=None if args.model_dir is None else str(args.model_dir))
  else:
    ptx.save_hf(ptx.Decoder(cfg.model, params=state.params), out)
  if args.model_dir is not None and jax.process_index() == 0:  # the one writer, as in save_hf
    for name in _TOKENIZER_FILES:
      if (args.model_dir / name).exists():
        shutil.copy(args.model_dir / name, out / name)
  return out


def synthetic_data(out: pathlib.Path, train: list[dict], evaluation: list[dict]) -> list[str]:
  """Writes a tiny preset's records to OUT/data/{train,eval}.jsonl; returns the --data overrides naming them."""
  (out / "data").mkdir(parents=True, exist_ok=True)
  overrides = []
  for name, records in (("train", train), ("eval", evaluation)):
    path = out / "data" / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides.append(f"--data.{name}_files={json.dumps([str(path)])}")
  return overrides


def progress(args: argparse.Namespace) -> bool:
  """Whether to draw a progress bar: asked for, and on a terminal."""
  return not args.no_progress and sys.stderr.isatty()
