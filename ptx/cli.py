"""The `ptx` command line: `ptx version`, `ptx demo`, `ptx sft`, `ptx dpo`, `ptx grpo`, `ptx eval`, `ptx convert`,
`ptx demonstrations` (`ptx eval` is `ptx.eval_command`; `--env` and demonstrations are `ptx.env_flags`).

Every job takes `--out DIR`, an optional `--config FILE` (a JSON config tree,
such as a run's saved config.json) and overrides `--section.field=value`
applied after it (`--model=PRESET` swaps in a registered model preset).
`ptx sft|dpo|grpo` start from the toy preset and a fresh tiny model, or with
`--model-dir DIR` from an HF checkpoint and the fine-tuning preset
(`ptx.train.presets`, `ptx.train.pretrained`); one table, `_JOBS`, builds
each command's Job and data (`ptx.train.job`, `ptx.train.streams`), and
`--eval.suites='["arithmetic"]'` held-out suites evaluated at checkpoints
(`ptx.train.checkpoint_evals`).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import shlex
import sys

import ptx
from ptx import env_flags
from ptx import eval_command
from ptx import paths
from ptx import scoring_flags

_ALGORITHMS = {"sft": "SFT on prompt/completion or chat records",
               "dpo": "preference optimisation (DPO, cDPO, IPO, hinge, SimPO) on chosen/rejected records",
               "grpo": "GRPO-family RL (--grpo=grpo|dapo|dr_grpo|gspo|rloo|grpo_paper) on built-in arithmetic "
                       "or on rl records"}


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="ptx", description="Post-training for LLMs in JAX: SFT, DPO and GRPO in one SPMD program.",
      epilog="Config overrides: --model=PRESET, --model.d_model=256, --train.steps=100, ... Compiled programs are "
             "cached in ~/.cache/ptx/jax (PTX_COMPILATION_CACHE=DIR moves it, =off turns it off).")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  sub.add_parser("version", help="print the ptx, jax and flax versions")
  # No abbreviations: `--model=PRESET` is a config override, never short for --model-dir.
  demo = sub.add_parser("demo", allow_abbrev=False,
                        help="SFT a tiny model on built-in arithmetic; before/after exact match",
                        description="Train the tiny preset by SFT on 2-digit addition and report held-out "
                        "exact match before and after. Accepts config overrides, e.g. --train.steps=100.")
  _job_arguments(demo, default_out="out/demo")
  demo.add_argument("--rl-steps", type=int, default=400, help="GRPO steps after SFT")
  convert = sub.add_parser("convert", help="convert a checkpoint into a Hugging Face directory")
  convert.add_argument("format", choices=["gguf"], help="source format")
  convert.add_argument("src", type=pathlib.Path, help="source file (e.g. model.gguf)")
  convert.add_argument("dst", type=pathlib.Path, help="HF directory to write (weights, config, tokenizer)")
  convert.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                       help="stored dtype (default bfloat16: half the size, but rounded; on SmolLM2-135M it moves "
                       "logits by up to 0.28 against float32. float32 keeps the dequantised weights exactly)")
  eval_command.add_command(sub)
  env_flags.add_demonstrations_command(sub)
  _add_jobs(sub)
  return parser


def _add_jobs(sub) -> None:
  """Adds `ptx sft`, `dpo` and `grpo` and their flags to the subparsers `sub`."""
  for name, help_text in _ALGORITHMS.items():
    job = sub.add_parser(name, allow_abbrev=False, help=help_text,
                         description=f"{help_text}. Data: --data.train_files='[\"a.jsonl\"]'. Without "
                         "--model-dir: a fresh tiny model, the toy preset (ptx.train.presets.TOY); with it: the "
                         "checkpoint's architecture, weights and tokenizer, the fine-tuning preset (FINETUNE).")
    job.add_argument("--config", type=paths.argument, help="JSON config file (e.g. a saved config.json) replacing the "
                     "preset")
    job.add_argument("--model-dir", type=paths.argument, help="start from pretrained weights: an HF directory "
                     "(config.json, safetensors, tokenizer; local or gs://) or a local .gguf file (converted into "
                     "OUT/pretrained)")
    _job_arguments(job, default_out=f"out/{name}")
    job.add_argument("--fields", action="store_true",
                     help="list every config field this command reads, with the value it would run with (the "
                     "preset's, or --config's, after the overrides on this line), as --section.field=value lines "
                     "quoted for the shell, to pass back, and exit; with --model-dir the model section and "
                     "data.tokenizer come from the checkpoint when the run starts")
    job.add_argument("--no-export", action="store_true",
                     help="skip writing OUT/hf (HF weights + tokenizer; with LoRA also OUT/adapter in PEFT layout)")
    if name == "grpo":
      _add_grpo_arguments(job)


def _add_grpo_arguments(job: argparse.ArgumentParser) -> None:
  """Adds what `ptx grpo` reads beside the job flags: its environments and their scoring."""
  job.description += (" Without --data.train_files: 2-digit addition, exact match scored in-graph (fused "
                      "mode; data.batch_size prompts of data.seq_len tokens, grpo.max_response_tokens new). "
                      "With them: rl records scored on the host by --env (host-reward mode). --env code "
                      "without them: HumanEval's training problems, scored on the host. --env calculator, "
                      "terminal or docqa: multi-turn episodes in that environment, on its built-in tasks "
                      "without --data.train_files.")
  job.add_argument("--env", type=env_flags.env_flag, default="exact_answer", metavar="ENV | ENV[:WEIGHT],...",
                   help="environment scoring rl records: exact_answer (final answer, as math or text), "
                   "reasoning_gym (reasoning-gym families' own checkers; without --data.train_files: their "
                   "problems, --families), code "
                   "(unit tests in the sandbox; without --data.train_files: HumanEval's first 132 problems); "
                   "multi-turn episodes: calculator (word problems, a calculator "
                   "tool), terminal (fix a bug with shell commands in the sandbox, a hidden check), docqa "
                   "(questions about a long document, search and read tools) or bfcl (one turn of function "
                   "calls in the model family's form, BFCL's training split, AST-checked). Several, with weights "
                   "(--env reasoning_gym:3,bfcl): a step draws each task from one of their built-in training "
                   "tasks (or reads {\"env\", \"task\"} records), all played as episodes; metrics "
                   "episodes/reward/<env> per environment")
  job.add_argument("--families", metavar="NAME[:WEIGHT],...",
                   help="--env reasoning_gym: the families a step's prompts are drawn from, by weight (default: "
                   "a mix of 12; the reasoning_gym suite holds out other generator seeds of the same families)")
  job.add_argument("--answer-match", choices=("math", "text"), default="math",
                   help="--env exact_answer: match the final answer as math (the stated answer or last number, "
                   "symbolically equal) or as text (a word or phrase, normalised; the record's answer may "
                   "list aliases)")
  scoring = job.add_argument_group("host scoring and terminal episodes (--env exact_answer or code on rl "
                                   "records; --env terminal)")
  scoring_flags.add_arguments(scoring)


def _job_arguments(parser: argparse.ArgumentParser, default_out: str) -> None:
  parser.add_argument("--out", type=paths.argument, default=default_out, help="run directory (local or gs://)")
  parser.add_argument("--resume", action="store_true", help="continue the run in --out from its newest intact "
                      "checkpoint (refused when the config changes the model or the data)")
  parser.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out (deletes its "
                      "checkpoints, metrics and exports); without --resume or --overwrite an earlier run is refused")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
  multi = parser.add_argument_group("multi-host (run the same command on every host)")
  multi.add_argument("--distributed", action="store_true",
                     help="jax.distributed.initialize() with auto-detection (TPU pods, GKE, SLURM)")
  multi.add_argument("--coordinator", metavar="HOST:PORT", help="explicit coordinator (e.g. CPU clusters)")
  multi.add_argument("--num-processes", type=int, help="with --coordinator: number of processes")
  multi.add_argument("--process-id", type=int, help="with --coordinator: this process's index")


def main(argv: list[str] | None = None) -> int:
  """Runs the command line; returns the process exit code."""
  parser = _parser()
  args, overrides = parser.parse_known_args(argv)
  if args.command == "version":
    import flax
    import jax

    print(f"ptx {ptx.__version__} (jax {jax.__version__}, flax {flax.__version__})")
    return 0
  if args.command == "convert":
    if overrides:
      parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    from ptx.models.gguf import GGUFError, convert_gguf

    try:
      dst = convert_gguf(args.src, args.dst, dtype=args.dtype)
    except ImportError as e:
      parser.error(f"ptx convert gguf needs the gguf extra (pip install 'ptx[gguf]'): {e}")
    except (GGUFError, OSError) as e:
      parser.error(str(e))
    rounded = " (rounded from the dequantised float32; --dtype float32 keeps them exactly)"
    print(f"converted {args.src} into {dst}: {args.dtype} weights{rounded if args.dtype != 'float32' else ''}")
    return 0
  from ptx import compile_cache

  compile_cache.enable()  # before anything compiles
  if args.command == "eval":
    return eval_command.run(args, overrides, parser.error)
  if args.command == "demonstrations":
    if overrides:
      parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    try:
      env_flags.demonstrations(args)
    except (OSError, ValueError) as e:
      parser.error(str(e))
    return 0
  import jax

  # Pinned so RNG streams do not change when JAX's default does (STYLE 17).
  jax.config.update("jax_threefry_partitionable", True)
  if args.coordinator:
    if args.num_processes is None or args.process_id is None:
      parser.error("--coordinator needs --num-processes and --process-id")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts; ignored by TPU/GPU
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
  elif args.distributed:
    jax.distributed.initialize()
  from ptx import config as config_lib
  from ptx import config_io

  progress = not args.no_progress and sys.stderr.isatty()
  try:  # everything a job is built from is checked here, before anything compiles
    if args.command == "demo":
      from ptx import demo

      cfg = config_io.apply_overrides(demo.default_config(), overrides)
      _check_exportable(cfg.model)  # the demo writes OUT/sft/hf and OUT/grpo/hf
    elif args.fields:  # nothing is read, converted or written
      from ptx.train.job import SECTIONS

      cfg = config_io.apply_overrides(_base_config(args), overrides)
      # eval: the held-out suites the command evaluates at checkpoints (`--eval.suites`), beside the job's sections.
      lines = config_io.fields(cfg, (*SECTIONS[args.command], "eval"))
      print("\n".join(shlex.quote(f"--{line}") for line in lines), flush=True)  # each pastes into a shell
      return 0
    else:
      from ptx.train import run_dir

      # Before anything is written into --out; the earlier run's results go only once training starts (fit).
      run_dir.agreed(functools.partial(run_dir.check, args.out, resume=args.resume, overwrite=args.overwrite))
      if run_dir.replaces(args.out, resume=args.resume, overwrite=args.overwrite):
        run_dir.clear(args.out, run_dir.CACHES, primary=jax.process_index() == 0)
      cfg, params, tokenizer, job, train, evaluation, evals = _prepare(args, overrides)
  except (config_lib.ConfigError, OSError, ValueError) as e:  # bad config, files or records: named in the message
    parser.error(str(e))
  try:
    if args.command == "demo":
      demo.run(cfg, args.out, rl_steps=args.rl_steps, resume=args.resume, overwrite=args.overwrite,
               progress=progress)
    else:
      _train(args, cfg, params, tokenizer, job, train, evaluation, evals, progress)
  except _run_errors() as e:  # the run refused or stopped: the message says why and what was kept
    print(f"ptx {args.command}: error: {e}", file=sys.stderr, flush=True)
    return 2 if isinstance(e, ValueError) else 1
  return 0


def _run_errors() -> tuple[type[Exception], ...]:
  """Errors that end a run with a message rather than a traceback (refusals exit 2, stops 1)."""
  from ptx.data.records import RecordError
  from ptx.data.sources import NoDataError
  from ptx.train.checkpoint import CheckpointError
  from ptx.train.export import NonFiniteParams
  from ptx.train.loop import DivergedError
  from ptx.train.memory_check import OutOfMemory
  from ptx.train.metrics import MetricsFileError
  from ptx.train.run_dir import RunDirError

  return (RunDirError, CheckpointError, DivergedError, MetricsFileError, NonFiniteParams, RecordError,
          NoDataError, OutOfMemory)


def _prepare(args, overrides: list[str]):
  """`ptx sft|dpo|grpo`: (cfg, starting params, tokenizer, Job, training data, held-out batches or None,
  the held-out suites of `--eval.suites` or None)."""
  from ptx.train import checkpoint_evals, pretrained

  cfg, params, tokenizer = pretrained.configure(_base_config(args), overrides, model_dir=args.model_dir, out=args.out)
  if not args.no_export:  # refused before the run, not after it
    _check_exportable(cfg.model)
  evals = checkpoint_evals.build(cfg.eval, tokenizer, cfg.rollout)
  return (cfg, params, tokenizer, *_JOBS[args.command](cfg, tokenizer, args, params), evals)


def _check_exportable(model) -> None:
  """Raises ConfigError when OUT/hf could not hold `model` (no HF family expresses it)."""
  from ptx.config import ConfigError
  from ptx.models.hf_config import HFConfigError
  from ptx.models.hf_save import check_exportable

  try:
    check_exportable(model)
  except HFConfigError as e:
    raise ConfigError(f"OUT/hf cannot hold this model ({e}); pass --no-export to train it without the export") from None


def _base_config(args):
  """The config `ptx sft|dpo|grpo` starts from, before its overrides: --config's, else the command's preset (the
  fine-tuning one with --model-dir)."""
  from ptx import config as config_lib
  from ptx import config_io
  from ptx.train import presets

  if args.config is None:
    return (presets.FINETUNE if args.model_dir is not None else presets.TOY)[args.command]()
  try:
    return config_io.from_dict(config_lib.Config, json.loads(args.config.read_text()))
  except json.JSONDecodeError as e:
    raise config_lib.ConfigError(f"--config {args.config}: not valid JSON ({e})") from e


def _train(args, cfg, params, tokenizer, job, train, evaluation, evals, progress: bool) -> None:
  """Runs the job, then writes OUT/hf (and OUT/adapter under LoRA) unless --no-export or preempted."""
  from ptx.train.loop import fit


  state, summary = fit(cfg, job, train_data=train, out=args.out, resume=args.resume, overwrite=args.overwrite,
                       eval_data=evaluation, init_params=params, evals=evals, progress=progress)
  if not args.no_export and not summary["preempted"]:  # a preempted run has nothing final to export
    from ptx.train.export import export_hf

    base_model = None if args.model_dir is None else str(args.model_dir)
    written = export_hf(state, cfg, args.out, tokenizer, base_model=base_model)
    print(json.dumps({"exported": {k: str(v) for k, v in written.items()}}), flush=True)


def _supervised(cfg, tokenizer, args, params):
  """The SFT or DPO-family job (`args.command`) and its JSONL data."""
  from ptx.train import job, streams

  built = {"sft": job.sft_job, "dpo": job.dpo_job}[args.command](cfg, tokenizer)
  return (built, *streams.supervised(cfg, tokenizer, out=args.out, init_params=params))


def _grpo(cfg, tokenizer, args, params):
  """The fused job on built-in arithmetic, the host-reward job on rl records scored by --env, or the episode job of a
  multi-turn --env or of several; the records (`streams.rl_tasks`), or the built-in episodes' first prompts
  (`streams.check_builtin_prompts`), are checked before a job is built."""
  from ptx.train import job, presets, streams

  mixed = args.env not in env_flags.ENVIRONMENTS
  in_process = mixed or args.env in ("calculator", "docqa", "bfcl") or (args.env == "exact_answer" and
                                                                         not cfg.data.train_files)
  if args.executor != "local" and in_process:
    raise ValueError(f"--executor={args.executor} scores rl records on the host (--data.train_files with --env "
                     "exact_answer, --env code) and runs terminal episodes' commands (--env terminal); in-graph "
                     "rewards, mixtures of environments and --env calculator, docqa or bfcl run in this process")
  if args.answer_match != "math" and args.env != "exact_answer":
    raise ValueError(f"--answer-match sets how --env exact_answer matches answers; --env {args.env} has none")
  if args.families and "reasoning_gym" not in env_flags.mixed_names(args.env)[0]:
    raise ValueError(f"--families chooses --env reasoning_gym's task families; --env {args.env} has none")
  if args.warm_pool and args.env != "terminal":
    raise ValueError(f"--warm-pool needs --env terminal (it prepares terminal workspaces ahead), got --env {args.env}")
  if mixed or args.env in env_flags.EPISODES:
    env, builtin, fields = (env_flags.mixture(args, tokenizer) if mixed else
                            env_flags.builtin(args.env, args, tokenizer))
    # The prompts checked against data.seq_len are the episodes' first, as the environment poses them.
    if cfg.data.train_files:
      tasks = streams.rl_tasks(cfg, tokenizer, env, fields, episodes=True)
    else:
      tasks = builtin(cfg.train.seed)
      streams.check_builtin_prompts(cfg, tokenizer, env, tasks, episodes=True)
      print(f"ptx grpo: no --data.train_files: training on the built-in {args.env} tasks "
            f"({type(tasks).__name__} seed {cfg.train.seed}, train split)", flush=True)
    built = job.grpo_episode_job(cfg, tokenizer, env)
    return built, streams.grpo_prompts(cfg, tokenizer, tasks, in_graph=False, episodes=env), None
  from ptx.episodes.scoring import EnvReward

  if args.env in ("reasoning_gym", "code") and not cfg.data.train_files:
    env, builtin, _ = env_flags.builtin(args.env, args, tokenizer)
    tasks = builtin(cfg.train.seed)
    streams.check_builtin_prompts(cfg, tokenizer, env, tasks, episodes=False)
    if args.env == "reasoning_gym":
      print(f"ptx grpo: no --data.train_files: training on reasoning-gym's {', '.join(tasks.families)} (train "
            f"seeds; the reasoning_gym suite's are held out)", flush=True)
    else:
      from ptx.envs import humaneval

      print(f"ptx grpo: no --data.train_files: training on HumanEval's first {len(tasks)} problems (the last "
            f"{humaneval.HELD_OUT}, suite humaneval_held_out, are held out)", flush=True)
  elif not cfg.data.train_files:
    from ptx.data.arithmetic import ArithmeticTask

    built = job.grpo_job(cfg, tokenizer)
    print(f"ptx grpo: no --data.train_files: training on the built-in {presets.DIGITS}-digit addition prompts "
          f"(ArithmeticTask seed {presets.GRPO_SEED}), reward computed in-graph", flush=True)
    tasks = ArithmeticTask(presets.GRPO_SEED, presets.DIGITS)
    return built, streams.grpo_prompts(cfg, tokenizer, tasks, in_graph=True), None
  else:
    env, fields = env_flags.environment(args.env, args.answer_match)
    tasks = streams.rl_tasks(cfg, tokenizer, env, fields)
  reward = EnvReward(env, tokenizer, (tokenizer.eos_id,), cfg.grpo.group_size, **scoring_flags.reward_options(args))
  built = job.grpo_host_job(cfg, tokenizer, reward)
  return built, streams.grpo_prompts(cfg, tokenizer, tasks, in_graph=False), None


# `ptx sft|dpo|grpo`: (cfg, tokenizer, args, starting params) -> (Job, training data, held-out batches or None).
_JOBS = {"sft": _supervised, "dpo": _supervised, "grpo": _grpo}


if __name__ == "__main__":
  sys.exit(main())
