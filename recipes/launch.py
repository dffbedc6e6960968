"""What every recipe shares: its flags, multi-host start-up, its config and its starting weights.

A recipe is a `PRESETS` table of configs plus a short `main`. `parse` reads
the common flags (`--preset`, `--out`, `--model-dir`, `--resume`, the
multi-host ones) and leaves `--section.field=value` overrides to `configure`
(`data_recipe` does all three for the recipes that read JSONL data).
On a pod every host runs the same command with `--distributed`; `start`
initialises `jax.distributed` before any JAX computation. Recipes import this
module as `launch` (a script's own folder is first on `sys.path`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
from typing import Any, Callable

import jax

import ptx
from ptx import config as config_lib
from ptx.data.hf_tokenizer import load_tokenizer
from ptx.data.pipeline import make_pipeline
from ptx.data.sources import JsonlSource
from ptx.train.export import export_hf
from ptx.train.loop import fit

Presets = dict[str, Callable[[], ptx.Config]]


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
  if args.model_dir is None and args.preset != "tiny":
    args.error(f"--preset {args.preset} fine-tunes real weights: pass --model-dir HF_DIR")
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


class RenderedPromptTokenizer:
  """A model's tokenizer for prompts its chat template already rendered as text: no bos is prepended.

  The samplers put `bos_id` before a text prompt; a chat template writes its
  own start token (Llama 3's <|begin_of_text|>; SmolLM2 even names
  <|im_start|> its bos_token), so a rendered prompt must not get a second.
  """

  bos_id = None

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer

  def __getattr__(self, name):
    return getattr(self._tokenizer, name)


def prompt_tokenizer(tokenizer):
  """The tokenizer to encode `chat_prompt` texts with: bos left to the template where there is one."""
  return tokenizer if getattr(tokenizer, "chat_template", None) is None else RenderedPromptTokenizer(tokenizer)


def chat_prompt(tokenizer, text: str, reply_start: str = "") -> str:
  """`text` as a user turn rendered by the tokenizer's chat template (plain `text` without one)."""
  template = getattr(tokenizer, "chat_template", None)
  if template is None:
    return text + reply_start
  return template.render([{"role": "user", "content": text}], add_generation_prompt=True) + reply_start


def data_recipe(doc: str, presets: Presets, argv: list[str] | None,
                synthetic: Callable[[int, int], list[dict]], n: int) -> tuple[argparse.Namespace, ptx.Config, Any, Any]:
  """`parse`, `start` and `configure` for a recipe reading --data.train_files / eval_files.

  The tiny preset first writes `synthetic(seed, count)` records (n to train
  on, 64 held out) and names them, so `--data.*` overrides still win.
  """
  args, overrides = parse(doc, presets, argv)
  start(args)
  if args.preset == "tiny":
    overrides = [*synthetic_data(args.out, synthetic(0, n), synthetic(1, 64)), *overrides]
  cfg, params, tokenizer = configure(args, presets[args.preset](), overrides)
  if not cfg.data.train_files:
    args.error("set --data.train_files='[\"train.jsonl\"]'")
  return args, cfg, params, tokenizer


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


def run_sft(doc: str, presets: Presets, argv: list[str] | None, synthetic: Callable[[int, int], list[dict]],
            n: int) -> dict:
  """An SFT recipe's whole run: `data_recipe`, the pipelines, `fit`, then the HF export; returns fit's summary."""
  args, cfg, params, tokenizer = data_recipe(doc, presets, argv, synthetic, n)
  pipeline = functools.partial(make_pipeline, tokenizer=tokenizer, process_index=jax.process_index(),
                               process_count=jax.process_count())
  evaluation = None
  if cfg.data.eval_files:
    eval_cfg = dataclasses.replace(cfg.data, shuffle=False, num_epochs=1)
    evaluation = list(pipeline(JsonlSource(cfg.data.eval_files), cfg=eval_cfg))
  state, summary = fit(cfg, loss_fn=functools.partial(ptx.sft.loss, model=cfg.model),
                       train_data=pipeline(JsonlSource(cfg.data.train_files), cfg=cfg.data), out=args.out,
                       resume=args.resume, eval_data=evaluation, init_params=params, progress=progress(args))
  export_hf(state, cfg, args.out, tokenizer, base_model=None if args.model_dir is None else str(args.model_dir))
  return summary
