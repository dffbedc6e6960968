"""The command line's `--env`: the environments it names, their built-in training tasks, mixtures of them, and the
demonstrations of those tasks (`ptx demonstrations`).

`ptx grpo --env NAME` scores rl records or plays episodes in one environment; `--env A[:W],B` mixes environments
with built-in training tasks by weight (`ptx.envs.mixture`). Each builder returns finished objects (the
environment, a function of the seed giving its task stream, the fields its records need), which the commands use
as they are.
"""

from __future__ import annotations

import argparse
import json

from ptx import paths
from ptx import scoring_flags

# `ptx grpo --env`: single-turn environments that score rl records on the host, and multi-turn ones (episodes).
ENVIRONMENTS = ("exact_answer", "code", "reasoning_gym", "calculator", "terminal", "docqa", "bfcl")
# bfcl is single-turn, played as an episode because its prompt is the environment's (the functions, the call form).
EPISODES = ("calculator", "terminal", "docqa", "bfcl")
# Environments with built-in training tasks, which `--env A,B:W` mixes, played as episodes.
MIXABLE = ("reasoning_gym", "code") + EPISODES
# Environments whose built-in training tasks `ptx demonstrations` solves (their `demonstration`).
DEMONSTRABLE = ("reasoning_gym", "calculator", "bfcl")


def env_flag(value: str) -> str:
  """`--env`: one environment, or a comma list of mixable ones with optional weights (checked here, parsed later)."""
  from ptx.envs.mixture import weighted_names

  entries = [entry.strip() for entry in value.split(",")]
  if len(entries) == 1 and entries[0] in ENVIRONMENTS:
    return entries[0]
  try:
    names, _ = weighted_names(entries, "--env's environments")
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  unknown = [n for n in names if n not in MIXABLE]
  if len(names) < 2 or unknown:
    raise argparse.ArgumentTypeError(f"{value!r}: one of {ENVIRONMENTS}, or several of {MIXABLE} (those with "
                                     "built-in training tasks) as NAME[:WEIGHT],... to mix")
  return value


def mixed_names(flag: str) -> tuple[tuple[str, ...], tuple[float, ...]]:
  """The environments of `--env` (one, or a mixture's) and their weights."""
  from ptx.envs.mixture import weighted_names

  return weighted_names([entry.strip() for entry in flag.split(",")], "--env's environments")


def mixture(args, tokenizer):
  """(MixtureEnv, its built-in tasks of a seed: `MixedTasks` by `--env`'s weights, the fields its records need) of
  `--env A[:W],B[:W],...` (or of one environment, a mixture of one)."""
  from ptx.envs.mixture import MixedTasks, MixtureEnv

  names, weights = mixed_names(args.env)
  envs, builtins, _ = zip(*(builtin(name, args, tokenizer) for name in names))
  return (MixtureEnv(names, envs), lambda seed: MixedTasks(names, tuple(b(seed) for b in builtins), weights, seed),
          ("env", "task"))


def add_demonstrations_command(sub) -> None:
  """Adds `ptx demonstrations` and its flags to the command line's subparsers `sub`."""
  demos = sub.add_parser("demonstrations", allow_abbrev=False,
                         help="write SFT records of environments' training tasks solved right (to teach the "
                         "answer form before RL)",
                         description="Write --n chat records {\"messages\": [...]} of the built-in training tasks "
                         "of --env, each the episode's prompt answered right (reasoning_gym: the family's answer in "
                         "<answer></answer> tags, no reasoning; bfcl: the expected calls in the model family's form; "
                         "calculator: a calculator call, its result, the answer), checked by the environment, "
                         "for ptx sft --data.train_files. The tasks are the training split ptx grpo --env draws "
                         "(the same seed, the same records); the eval suites' held-out tasks are never among them.")
  demos.add_argument("--env", type=env_flag, required=True, metavar="ENV | ENV[:WEIGHT],...",
                     help=f"one of {DEMONSTRABLE}, or several with weights, drawn as ptx grpo --env mixes "
                     "them")
  demos.add_argument("--n", type=int, required=True, help="number of records")
  demos.add_argument("--model-dir", type=paths.argument,
                     help="the model the records are for: its chat template picks the tool-call form (default: "
                     "hermes)")
  demos.add_argument("--families", metavar="NAME[:WEIGHT],...",
                     help="--env reasoning_gym's families (default: a mix of 12)")
  demos.add_argument("--seed", type=int, default=0, help="the task stream's seed (ptx grpo's --train.seed)")
  demos.add_argument("--out", type=paths.argument, required=True, help="JSONL file to write (local or gs://)")


def demonstrations(args) -> None:
  """`ptx demonstrations`: writes --n solved training tasks of --env as SFT chat records, and prints their count per
  environment.

  One environment is drawn as a mixture of one: `MixedTasks`' record i is its source's record i, the stream
  `ptx grpo --env` trains on.
  """
  names, _ = mixed_names(args.env)
  refused = [name for name in names if name not in DEMONSTRABLE]
  if refused:
    raise ValueError(f"--env {args.env}: {', '.join(refused)} has no demonstrations; environments with them: "
                     f"{DEMONSTRABLE}")
  if args.n < 1:
    raise ValueError(f"--n must be at least 1, got {args.n}")
  tokenizer = None
  if args.model_dir is not None:
    from ptx.data.hf_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model_dir)
  env, builtin_tasks, _ = mixture(args, tokenizer)
  tasks = builtin_tasks(args.seed)
  lines, counts = [], dict.fromkeys(names, 0)
  for i in range(args.n):
    task = tasks[i]
    lines.append(json.dumps({"messages": env.demonstration(task)}))
    counts[env.label(task)] += 1
  out = paths.path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  paths.write_atomic(out, "\n".join(lines) + "\n")
  print(json.dumps({"demonstrations": args.n, "by_env": counts, "seed": args.seed, "out": str(out)}), flush=True)


def builtin(name: str, args, tokenizer):
  """(environment, its built-in training tasks of a seed, the fields its records need) of `ptx grpo --env NAME`,
  for the environments that have built-in tasks (`MIXABLE`)."""
  if name == "reasoning_gym":
    from ptx.envs import reasoning_gym

    mix = reasoning_gym.parse_families(families(args.families))
    return (reasoning_gym.ReasoningGymEnv(),
            lambda seed: reasoning_gym.ReasoningGymTasks(*mix, seed=seed, split="train"), ("family", "entry"))
  if name == "code":
    from ptx.envs import humaneval
    from ptx.envs.python_tests import PythonTestsEnv

    return PythonTestsEnv(limits=humaneval.LIMITS), lambda seed: humaneval.HumanEvalTasks("train"), ("tests",)
  return episode_environment(name, tokenizer, scoring_flags.shell_options(args) if name == "terminal" else None)


def episode_environment(name: str, tokenizer, shell: dict | None = None):
  """(environment, built-in tasks of a seed, the fields its records need) of `ptx grpo --env NAME` for episodes;
  `shell`: the terminal's `ShellEnv` options (`scoring_flags.shell_options`: executor, warm pool)."""
  if name == "calculator":
    from ptx.envs.calculator import CalculatorEnv, CalculatorTasks

    return CalculatorEnv(), CalculatorTasks, ("answer",)
  if name == "terminal":
    from ptx.envs.shell import ShellEnv
    from ptx.envs.terminal import TerminalTasks

    return ShellEnv(**(shell or {})), TerminalTasks, ("files", "check")
  if name == "bfcl":
    from ptx.envs.bfcl import BFCLEnv, BFCLTasks
    from ptx.envs.tools import family_format

    return BFCLEnv(tool_format=family_format(tokenizer)), BFCLTasks, ("prompt", "functions", "answer", "category")
  from ptx.envs.docqa import DocQAEnv, DocQATasks

  return DocQAEnv(tokenizer), DocQATasks, ("document", "question", "answer")


def environment(name: str, answer_match: str):
  """(environment, the fields its records need) of `ptx grpo --env NAME`; `answer_match`: exact_answer's match."""
  from ptx.envs.exact_answer import ExactAnswerEnv
  from ptx.envs.python_tests import PythonTestsEnv

  if name == "exact_answer":
    return ExactAnswerEnv(match=answer_match), ("answer",)
  if name == "reasoning_gym":
    from ptx.envs.reasoning_gym import ReasoningGymEnv

    return ReasoningGymEnv(), ("family", "entry")
  return PythonTestsEnv(), ("tests",)  # --env code


def families(flag: str | None) -> tuple[str, ...]:
  """`--families NAME[:WEIGHT],...` as entries (empty: the default mix)."""
  return tuple(entry.strip() for entry in flag.split(",") if entry.strip()) if flag else ()
