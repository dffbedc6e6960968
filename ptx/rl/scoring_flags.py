"""Where host rewards are scored: the command-line flags `ptx grpo` and the recipes share, and what they build.

`add_arguments` puts the flags on a parser (or group); `reward_options`
turns the parsed flags into `EnvReward`'s keyword arguments (executor,
concurrency, timeout), refusing what they cannot do by the flag's name. One
definition, so `ptx grpo --executor=ray ...` and `python recipes/grpo_code.py
--executor=ray ...` take the same flags with the same defaults.
"""

from __future__ import annotations

import argparse

# With --executor=ray, a sample's scoring that outlives this is an infrastructure error, so a job its cluster lost
# without a word cannot stall training (ten minutes: far beyond a sandboxed test run's own limits).
RAY_SCORE_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
  """Adds --executor, --ray-address, --ray-resources, --score-concurrency and --score-timeout-s to `parser`."""
  parser.add_argument("--executor", choices=("local", "ray"), default="local",
                      help="where samples are scored: in this process, or as Ray tasks on a cluster's CPU nodes "
                      "(the ray extra; docs/DESIGN.md has the launch note)")
  parser.add_argument("--ray-address", help="with --executor=ray: the cluster (auto, HOST:6379); default: "
                      "RAY_ADDRESS, else a new local cluster")
  parser.add_argument("--ray-resources", default="num_cpus=1", metavar="NAME=AMOUNT,...",
                      help="with --executor=ray: what each scoring task reserves on its node: num_cpus, "
                      "memory_bytes and custom resources the nodes declare (e.g. num_cpus=1,sandbox=1)")
  parser.add_argument("--score-concurrency", type=int, default=32,
                      help="samples scored at once (with --executor=ray: at most the task slots the nodes offer, "
                      "so that jobs wait in priority order here rather than in Ray's queue)")
  parser.add_argument("--score-timeout-s", type=float,
                      help="seconds a sample's scoring may run before it counts as an infrastructure error "
                      f"(default: none locally, {RAY_SCORE_TIMEOUT_S:g} with --executor=ray)")


def reward_options(args: argparse.Namespace) -> dict:
  """`EnvReward`'s executor, concurrency and timeout from the flags of `add_arguments`.

  Raises:
    ValueError: naming the flag, for values the flags cannot take together or a missing ray extra.
  """
  if args.score_concurrency < 1:
    raise ValueError(f"--score-concurrency must be >= 1, got {args.score_concurrency}")
  if args.score_timeout_s is not None and args.score_timeout_s <= 0:
    raise ValueError(f"--score-timeout-s must be > 0, got {args.score_timeout_s}")
  if args.executor == "local":
    if args.ray_address is not None:
      raise ValueError("--ray-address needs --executor=ray")
    return {"concurrency": args.score_concurrency, "timeout_s": args.score_timeout_s}
  from ptx.rl.executors import Resources

  resources = Resources.parse(args.ray_resources)
  try:
    from ptx.rl.ray_executor import RayExecutor
  except ImportError as e:
    raise ValueError(f"--executor=ray needs the ray extra (pip install 'ptx[ray]'): {e}") from e
  timeout_s = RAY_SCORE_TIMEOUT_S if args.score_timeout_s is None else args.score_timeout_s
  return {"executor": RayExecutor(args.ray_address, resources), "concurrency": args.score_concurrency,
          "timeout_s": timeout_s}
