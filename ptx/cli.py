"""The `ptx` command line: `ptx version`, `ptx demo`, and the training jobs as they land.

Every job takes `--out DIR` and config overrides `--section.field=value`
(`--model=PRESET` swaps in a registered model preset first).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import ptx


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="ptx", description="Post-training for LLMs in JAX: SFT, DPO and GRPO in one SPMD program.",
      epilog="Config overrides: --model=PRESET, --model.d_model=256, --train.steps=100, ...")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  sub.add_parser("version", help="print the ptx, jax and flax versions")
  demo = sub.add_parser("demo", help="SFT a tiny model on built-in arithmetic; before/after exact match",
                        description="Train the tiny preset by SFT on 2-digit addition and report held-out "
                        "exact match before and after. Accepts config overrides, e.g. --train.steps=100.")
  demo.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/demo"), help="output directory")
  demo.add_argument("--no-progress", action="store_true", help="print log lines instead of a progress bar")
  return parser


def main(argv: list[str] | None = None) -> int:
  """Runs the command line; returns the process exit code."""
  parser = _parser()
  args, overrides = parser.parse_known_args(argv)
  if args.command == "version":
    import flax
    import jax

    print(f"ptx {ptx.__version__} (jax {jax.__version__}, flax {flax.__version__})")
    return 0
  import jax

  # Pinned so RNG streams do not change when JAX's default does (STYLE 17).
  jax.config.update("jax_threefry_partitionable", True)
  from ptx import config as config_lib
  from ptx import demo

  try:
    cfg = config_lib.apply_overrides(demo.default_config(), overrides)
  except config_lib.ConfigError as e:
    parser.error(str(e))
  demo.run(cfg, args.out, progress=not args.no_progress and sys.stderr.isatty())
  return 0


if __name__ == "__main__":
  sys.exit(main())
