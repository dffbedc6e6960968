"""Where host rewards and terminal episodes run: the command-line flags `ptx grpo` and the recipes share.

`add_arguments` puts the flags on a parser (or group); `reward_options`
turns the parsed flags into `EnvReward`'s keyword arguments (executor,
concurrency, timeout) and `shell_options` into `ShellEnv`'s (the same, and a
warm pool), refusing what they cannot do by the flag's name. One definition,
so `ptx grpo --executor=ray ...` and `python recipes/grpo_code.py
--executor=ray ...` take the same flags with the same defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

# With --executor=ray, a sample's scoring (or a command's job) that outlives this is an infrastructure error, so a
# job its cluster lost without a word cannot stall training (ten minutes: far beyond a sandboxed run's own limits).
RAY_SCORE_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
  """Adds --executor, --ray-address, --ray-resources, --score-concurrency, --score-timeout-s and --warm-pool."""
  parser.add_argument("--executor", choices=("local", "ray"), default="local",
                      help="where samples are scored and terminal commands run: in this process, or as Ray tasks "
                      "on a cluster's CPU nodes (the ray extra; docs/DESIGN.md has the launch note)")
  parser.add_argument("--ray-address", help="with --executor=ray: the cluster (auto, HOST:6379); default: "
                      "RAY_ADDRESS, else a new local cluster")
  parser.add_argument("--ray-resources", default="num_cpus=1", metavar="NAME=AMOUNT,...",
                      help="with --executor=ray: what each task reserves on its node: num_cpus, "
                      "memory_bytes and custom resources the nodes declare (e.g. num_cpus=1,sandbox=1)")
  parser.add_argument("--score-concurrency", type=int, default=32,
                      help="samples scored (or terminal commands run) at once (with --executor=ray: at most the "
                      "task slots the nodes offer, so that jobs wait in priority order here rather than in Ray's "
                      "queue)")
  parser.add_argument("--score-timeout-s", type=float,
                      help="seconds a sample's scoring (a terminal command's job) may run before it counts as an "
                      f"infrastructure error (default: none locally, {RAY_SCORE_TIMEOUT_S:g} with --executor=ray)")
  parser.add_argument("--warm-pool", type=int, default=0, metavar="N",
                      help="terminal episodes: workspaces of up to N task states prepared ahead (the next batch's), "
                      "their set-ups run where the commands do; 0 (the default): each episode prepares its own")


def reward_options(args: argparse.Namespace) -> dict[str, Any]:
  """`EnvReward`'s executor, concurrency and timeout from the flags of `add_arguments`.

  Raises:
    ValueError: naming the flag, for values the flags cannot take together or a missing ray extra.
  """
  if args.warm_pool:
    raise ValueError(f"--warm-pool prepares terminal workspaces (ptx grpo --env terminal, recipes/grpo_agent.py); "
                     f"these rewards have none (got --warm-pool={args.warm_pool})")
  executor, concurrency, timeout_s = _where(args)
  return {"concurrency": concurrency, "timeout_s": timeout_s, **({} if executor is None else {"executor": executor})}


def shell_options(args: argparse.Namespace) -> dict[str, Any]:
  """`ShellEnv`'s executor, concurrency, job timeout and warm pool from the flags of `add_arguments`.

  The pool (`--warm-pool`) prepares on the same executor as the commands run on.

  Raises:
    ValueError: naming the flag, for values the flags cannot take together or a missing ray extra.
  """
  if args.warm_pool < 0:
    raise ValueError(f"--warm-pool must be >= 0 (0: off), got {args.warm_pool}")
  executor, concurrency, timeout_s = _where(args)
  pool = None
  if args.warm_pool:
    from ptx.envs.warm_pool import WarmPool

    # Locally the pool's set-ups are threads of this host: its own small default; on a cluster, as many as run.
    on_cluster = {} if executor is None else {"concurrency": concurrency}
    pool = WarmPool(size=args.warm_pool, executor=executor, **on_cluster)
  return {"executor": executor, "concurrency": concurrency, "job_timeout_s": timeout_s, "pool": pool}


def _where(args: argparse.Namespace) -> tuple[Any, int, float | None]:
  """(the executor, None for this process; concurrency; per-job timeout) of the flags, checked by name."""
  if args.score_concurrency < 1:
    raise ValueError(f"--score-concurrency must be >= 1, got {args.score_concurrency}")
  if args.score_timeout_s is not None and args.score_timeout_s <= 0:
    raise ValueError(f"--score-timeout-s must be > 0, got {args.score_timeout_s}")
  if args.executor == "local":
    if args.ray_address is not None:
      raise ValueError("--ray-address needs --executor=ray")
    return None, args.score_concurrency, args.score_timeout_s
  from ptx.scheduling.work import Resources

  resources = Resources.parse(args.ray_resources)
  try:
    from ptx.scheduling.ray_executor import RayExecutor
  except ImportError as e:
    raise ValueError(f"--executor=ray needs the ray extra (pip install 'ptx[ray]'): {e}") from e
  timeout_s = RAY_SCORE_TIMEOUT_S if args.score_timeout_s is None else args.score_timeout_s
  return RayExecutor(args.ray_address, resources), args.score_concurrency, timeout_s
