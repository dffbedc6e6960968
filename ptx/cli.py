"""The `ptx` command line: `ptx version`, `ptx demo`, `ptx sft`, `ptx dpo`, `ptx grpo`, `ptx eval`, `ptx convert`.

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
import dataclasses
import functools
import json
import pathlib
import shlex
import sys

import ptx
from ptx import paths
from ptx import scoring_flags

_ALGORITHMS = {"sft": "SFT on prompt/completion or chat records",
               "dpo": "preference optimisation (DPO, cDPO, IPO, hinge, SimPO) on chosen/rejected records",
               "grpo": "GRPO-family RL (--grpo=grpo|dapo|dr_grpo|gspo|rloo|grpo_paper) on built-in arithmetic "
                       "or on rl records"}
# `ptx grpo --env`: single-turn environments that score rl records on the host, and multi-turn ones (episodes).
_ENVIRONMENTS = ("exact_answer", "code", "reasoning_gym", "calculator", "terminal", "docqa", "bfcl")
# bfcl is single-turn, played as an episode because its prompt is the environment's (the functions, the call form).
_EPISODES = ("calculator", "terminal", "docqa", "bfcl")
# Environments with built-in training tasks, which `--env A,B:W` mixes, played as episodes.
_MIXABLE = ("reasoning_gym", "code") + _EPISODES
# Environments whose built-in training tasks `ptx demonstrations` solves (their `demonstration`).
_DEMONSTRABLE = ("reasoning_gym", "calculator", "bfcl")


def _env_flag(value: str) -> str:
  """`--env`: one environment, or a comma list of mixable ones with optional weights (checked here, parsed later)."""
  from ptx.envs.mixture import weighted_names

  entries = [entry.strip() for entry in value.split(",")]
  if len(entries) == 1 and entries[0] in _ENVIRONMENTS:
    return entries[0]
  try:
    names, _ = weighted_names(entries, "--env's environments")
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  unknown = [n for n in names if n not in _MIXABLE]
  if len(names) < 2 or unknown:
    raise argparse.ArgumentTypeError(f"{value!r}: one of {_ENVIRONMENTS}, or several of {_MIXABLE} (those with "
                                     "built-in training tasks) as NAME[:WEIGHT],... to mix")
  return value


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
  from ptx.config import EvalConfig

  ev = sub.add_parser("eval", allow_abbrev=False,
                      help="pass@k of a model on evaluation suites, or compare two reports or suite directories",
                      description="Sample k completions per task, score them in each suite's environment and "
                      "write OUT/eval.json (one suite) or OUT/SUITE/eval.json (several): pass@k, mean@k, outcome "
                      "counts; choice and perplexity are scored by log-likelihood instead (acc, acc_norm; bits per "
                      "byte, perplexity). Or --compare two reports, or two directories of suites (a run's "
                      "OUT/evals/step_0 and OUT/evals/step_N): exit status 0, or 1 when a suite's pass@1 fell (bits "
                      "per byte rose) by more than --threshold (2: bad arguments or reports). --rollout.mode=fast "
                      "samples int8 weights with n-gram speculative decoding, as ptx grpo's fast rollouts do (the "
                      "rollout section's other fields: --rollout.drafts, --rollout.verify_cost, --rollout.max_ngram).")
  ev.add_argument("--model", type=paths.argument,
                  help="Hugging Face model directory (weights and tokenizer; local or gs://)")
  ev.add_argument("--task", help="suite names, comma-separated: arithmetic, countdown, needle (long-context "
                  "retrieval), reasoning_gym (held-out problems of reasoning-gym families, see --families), bfcl "
                  "(function calls, BFCL's held-out split), humaneval (all 164 problems; "
                  "completion form, or a request with --chat), humaneval_held_out (the 32 ptx grpo --env code never "
                  "trains on), math, code, exact (prompts as written); multi-turn, played as episodes: calculator "
                  "(a calculator tool), terminal (fix a bug with shell commands in the sandbox), docqa (questions "
                  "about a long document through search tools), shell (your records); scored by log-likelihood: "
                  "choice (multiple-choice records: acc, acc_norm), perplexity (text: bits per byte)")
  ev.add_argument("--tasks-file", action="append", metavar="[SUITE=]PATH",
                  help="JSONL task records of a file suite (math, code, shell, exact, choice: {\"context\", "
                  "\"choices\", \"answer\"}; perplexity: {\"text\"} records, or a whole text file); SUITE= may "
                  "be left out when --task names one file suite; repeat for several")
  ev.add_argument("--n", type=int, default=100, help="number of tasks")
  ev.add_argument("--k", type=int, default=8, help="samples per task")
  ev.add_argument("--max-new-tokens", type=int, default=256, help="tokens a completion may sample (each turn of a "
                  "multi-turn suite)")
  ev.add_argument("--temperature", type=float, default=1.0, help="0 samples greedily")
  ev.add_argument("--chat", action="store_true", help="render prompts through the model's chat template "
                  "(multi-turn suites always are)")
  ev.add_argument("--answer-match", choices=("math", "text"), default="math",
                  help="how the exact suite matches answers: as math (the stated answer or last number, symbolically "
                  "equal) or as text (a word or phrase, normalised; a record's answer may list aliases); the report "
                  "says which")
  ev.add_argument("--families", metavar="NAME[:WEIGHT],...",
                  help="the reasoning_gym suite's families, comma-separated (default: a mix of 12 families)")
  ev.add_argument("--seed", type=int, default=0)
  ev.add_argument("--out", type=paths.argument, default="out/eval", help="report directory (local or gs://)")
  ev.add_argument("--compare", nargs=2, type=pathlib.Path, metavar=("A", "B"),
                  help="print B against A: two report files (the full table), or two directories of per-suite "
                  "reports (pass@1, pass@k, mean@k per suite)")
  ev.add_argument("--threshold", type=float, default=EvalConfig().regression,
                  help="--compare: the largest drop of pass@1 that is not a regression (default: eval.regression's)")
  demos = sub.add_parser("demonstrations", allow_abbrev=False,
                         help="write SFT records of environments' training tasks solved right (to teach the "
                         "answer form before RL)",
                         description="Write --n chat records {\"messages\": [...]} of the built-in training tasks "
                         "of --env, each the episode's prompt answered right (reasoning_gym: the family's answer in "
                         "<answer></answer> tags, no reasoning; bfcl: the expected calls in the model family's form; "
                         "calculator: a calculator call, its result, the answer), checked by the environment, "
                         "for ptx sft --data.train_files. The tasks are the training split ptx grpo --env draws "
                         "(the same seed, the same records); the eval suites' held-out tasks are never among them.")
  demos.add_argument("--env", type=_env_flag, required=True, metavar="ENV | ENV[:WEIGHT],...",
                     help=f"one of {_DEMONSTRABLE}, or several with weights, drawn as ptx grpo --env mixes them")
  demos.add_argument("--n", type=int, required=True, help="number of records")
  demos.add_argument("--model-dir", type=paths.argument,
                     help="the model the records are for: its chat template picks the tool-call form (default: "
                     "hermes)")
  demos.add_argument("--families", metavar="NAME[:WEIGHT],...",
                     help="--env reasoning_gym's families (default: a mix of 12)")
  demos.add_argument("--seed", type=int, default=0, help="the task stream's seed (ptx grpo's --train.seed)")
  demos.add_argument("--out", type=paths.argument, required=True, help="JSONL file to write (local or gs://)")
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
      job.description += (" Without --data.train_files: 2-digit addition, exact match scored in-graph (fused "
                          "mode; data.batch_size prompts of data.seq_len tokens, grpo.max_response_tokens new). "
                          "With them: rl records scored on the host by --env (host-reward mode). --env code "
                          "without them: HumanEval's training problems, scored on the host. --env calculator, "
                          "terminal or docqa: multi-turn episodes in that environment, on its built-in tasks "
                          "without --data.train_files.")
      job.add_argument("--env", type=_env_flag, default="exact_answer", metavar="ENV | ENV[:WEIGHT],...",
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
  return parser


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
    return _evaluate(args, overrides, parser.error)
  if args.command == "demonstrations":
    if overrides:
      parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    try:
      _demonstrations(args)
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
  evals = checkpoint_evals.build(cfg.eval, tokenizer, cfg.rollout)
  return (cfg, params, tokenizer, *_JOBS[args.command](cfg, tokenizer, args, params), evals)


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

  mixed = args.env not in _ENVIRONMENTS
  in_process = mixed or args.env in ("calculator", "docqa", "bfcl") or (args.env == "exact_answer" and
                                                                         not cfg.data.train_files)
  if args.executor != "local" and in_process:
    raise ValueError(f"--executor={args.executor} scores rl records on the host (--data.train_files with --env "
                     "exact_answer, --env code) and runs terminal episodes' commands (--env terminal); in-graph "
                     "rewards, mixtures of environments and --env calculator, docqa or bfcl run in this process")
  if args.answer_match != "math" and args.env != "exact_answer":
    raise ValueError(f"--answer-match sets how --env exact_answer matches answers; --env {args.env} has none")
  if args.families and "reasoning_gym" not in _mixed_names(args.env)[0]:
    raise ValueError(f"--families chooses --env reasoning_gym's task families; --env {args.env} has none")
  if args.warm_pool and args.env != "terminal":
    raise ValueError(f"--warm-pool needs --env terminal (it prepares terminal workspaces ahead), got --env {args.env}")
  if mixed or args.env in _EPISODES:
    env, builtin, fields = _mixture(args, tokenizer) if mixed else _builtin(args.env, args, tokenizer)
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
    env, builtin, _ = _builtin(args.env, args, tokenizer)
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
    env, fields = _environment(args.env, args.answer_match)
    tasks = streams.rl_tasks(cfg, tokenizer, env, fields)
  reward = EnvReward(env, tokenizer, (tokenizer.eos_id,), cfg.grpo.group_size, **scoring_flags.reward_options(args))
  built = job.grpo_host_job(cfg, tokenizer, reward)
  return built, streams.grpo_prompts(cfg, tokenizer, tasks, in_graph=False), None


def _mixed_names(flag: str) -> tuple[tuple[str, ...], tuple[float, ...]]:
  """The environments of `--env` (one, or a mixture's) and their weights."""
  from ptx.envs.mixture import weighted_names

  return weighted_names([entry.strip() for entry in flag.split(",")], "--env's environments")


def _mixture(args, tokenizer):
  """(MixtureEnv, its built-in tasks of a seed: `MixedTasks` by `--env`'s weights, the fields its records need) of
  `--env A[:W],B[:W],...`."""
  from ptx.envs.mixture import MixedTasks, MixtureEnv

  names, weights = _mixed_names(args.env)
  envs, builtins, _ = zip(*(_builtin(name, args, tokenizer) for name in names))
  return (MixtureEnv(names, envs), lambda seed: MixedTasks(names, tuple(b(seed) for b in builtins), weights, seed),
          ("env", "task"))


def _demonstrations(args) -> None:
  """`ptx demonstrations`: writes --n solved training tasks of --env as SFT chat records, and prints their count per
  environment."""
  names, _ = _mixed_names(args.env)
  refused = [name for name in names if name not in _DEMONSTRABLE]
  if refused:
    raise ValueError(f"--env {args.env}: {', '.join(refused)} has no demonstrations; environments with them: "
                     f"{_DEMONSTRABLE}")
  if args.n < 1:
    raise ValueError(f"--n must be at least 1, got {args.n}")
  tokenizer = None
  if args.model_dir is not None:
    from ptx.data.hf_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model_dir)
  env, builtin, _ = _mixture(args, tokenizer) if len(names) > 1 else _builtin(names[0], args, tokenizer)
  tasks = builtin(args.seed)
  lines, counts = [], dict.fromkeys(names, 0)
  for i in range(args.n):
    task = tasks[i]
    lines.append(json.dumps({"messages": env.demonstration(task)}))
    counts[env.label(task) if len(names) > 1 else names[0]] += 1
  out = paths.path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  paths.write_atomic(out, "\n".join(lines) + "\n")
  print(json.dumps({"demonstrations": args.n, "by_env": counts, "seed": args.seed, "out": str(out)}), flush=True)


def _builtin(name: str, args, tokenizer):
  """(environment, its built-in training tasks of a seed, the fields its records need) of `ptx grpo --env NAME`,
  for the environments that have built-in tasks (`_MIXABLE`)."""
  if name == "reasoning_gym":
    from ptx.envs import reasoning_gym

    families = reasoning_gym.parse_families(_families(args.families))
    return (reasoning_gym.ReasoningGymEnv(),
            lambda seed: reasoning_gym.ReasoningGymTasks(*families, seed=seed, split="train"), ("family", "entry"))
  if name == "code":
    from ptx.envs import humaneval
    from ptx.envs.python_tests import PythonTestsEnv

    return PythonTestsEnv(limits=humaneval.LIMITS), lambda seed: humaneval.HumanEvalTasks("train"), ("tests",)
  return _episode_environment(name, tokenizer, scoring_flags.shell_options(args) if name == "terminal" else None)


def _episode_environment(name: str, tokenizer, shell: dict | None = None):
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


def _environment(name: str, answer_match: str):
  """(environment, the fields its records need) of `ptx grpo --env NAME`; `answer_match`: exact_answer's match."""
  from ptx.envs.exact_answer import ExactAnswerEnv
  from ptx.envs.python_tests import PythonTestsEnv

  if name == "exact_answer":
    return ExactAnswerEnv(match=answer_match), ("answer",)
  if name == "reasoning_gym":
    from ptx.envs.reasoning_gym import ReasoningGymEnv

    return ReasoningGymEnv(), ("family", "entry")
  return PythonTestsEnv(), ("tests",)  # --env code


# `ptx sft|dpo|grpo`: (cfg, tokenizer, args, starting params) -> (Job, training data, held-out batches or None).
_JOBS = {"sft": _supervised, "dpo": _supervised, "grpo": _grpo}


def _evaluate(args, overrides: list[str], error) -> int:
  """`ptx eval`: a model's reports on one or more suites, or `--compare`; returns the exit status.

  Of the config overrides it takes the `rollout` section's (`--rollout.mode=fast`), as `ptx grpo` does.
  """
  from ptx import config_io
  from ptx.config import Config, ConfigError
  from ptx.episodes import evaluation

  other = [o for o in overrides if not o.startswith("--rollout.")]
  if other or (overrides and args.compare):
    error(f"unrecognized arguments: {' '.join(other or overrides)} (ptx eval takes --rollout.* overrides only)")
  try:
    rollout = config_io.apply_overrides(Config(), overrides).rollout
  except ConfigError as e:
    error(str(e))
  if args.compare:
    return _compare(args.compare, args.threshold, error)
  if args.model is None or args.task is None:
    error("ptx eval needs --model DIR and --task NAME[,NAME...] (or --compare A B)")
  from ptx.config import EvalConfig, SamplingConfig
  from ptx.data.hf_tokenizer import load_tokenizer
  from ptx.models import load_hf
  from ptx.models.hf_generation import read_generation
  from ptx.train import checkpoint_evals

  names = tuple(args.task.split(","))
  sampling = SamplingConfig(greedy=True) if args.temperature == 0 else SamplingConfig(temperature=args.temperature)
  try:  # a bad flag, a missing or cut file, a tokenizer larger than the model, a bad task record: named
    section = EvalConfig(suites=names, files=_task_files(names, args.tasks_file or ()), n=args.n, k=args.k,
                         max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, chat=args.chat,
                         answer_match=args.answer_match, families=_families(args.families))
    tokenizer = load_tokenizer(args.model)
    evals = checkpoint_evals.build(section, tokenizer, rollout)
    # Likelihood suites score sequences up to the context the model declares.
    declared = read_generation(args.model).max_position_embeddings
    evals = dataclasses.replace(evals, max_length=declared or evals.max_length)
    model = load_hf(args.model)
    reports = evals.evaluate(model.params, model.cfg)
  except (OSError, ValueError) as e:
    error(str(e))
  if len(reports) == 1:
    args.out.mkdir(parents=True, exist_ok=True)
    evaluation.write_report(reports[names[0]], args.out / evaluation.REPORT_FILE)
  else:
    evaluation.write_suites(reports, args.out)
  for report in reports.values():
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, list)}))
  return 0


def _families(flag: str | None) -> tuple[str, ...]:
  """`--families NAME[:WEIGHT],...` as entries (empty: the default mix)."""
  return tuple(entry.strip() for entry in flag.split(",") if entry.strip()) if flag else ()


def _task_files(names: tuple[str, ...], given) -> tuple[str, ...]:
  """`--tasks-file` entries as `eval.files`: SUITE=PATH kept, a bare PATH given to the one file suite named."""
  from ptx.envs import suites
  from ptx.episodes import likelihood

  file_suites = [name for name in names if name in suites.FILE_SUITES + tuple(likelihood.SUITES)]
  entries = []
  for entry in given:
    if entry.split("=", 1)[0] in suites.NAMES + tuple(likelihood.SUITES):
      entries.append(entry)
    elif len(file_suites) == 1:
      entries.append(f"{file_suites[0]}={entry}")
    else:
      raise ValueError(f"--tasks-file {entry}: say which suite reads it (SUITE=PATH); --task names the file suites "
                       f"{file_suites}")
  return tuple(entries)


def _compare(pair, threshold: float, error) -> int:
  """`ptx eval --compare A B`: prints B against A; 1 when a suite regressed (`evaluation.regressed`), else 0."""
  from ptx.episodes import evaluation

  a, b = pair
  try:
    if a.is_file() and b.is_file():  # two reports: the full table of each metric and outcome rate
      before, after = evaluation.read_report(a), evaluation.read_report(b)
      worse = [after.get("suite", str(b))] if evaluation.regressed(before, after, threshold) else []
      print(evaluation.compare(before, after, tolerance=threshold))
      print(evaluation.verdict(worse, threshold, perplexity="bits_per_byte" in before))
    else:
      table, worse = evaluation.compare_suites(evaluation.read_suites(a), evaluation.read_suites(b),
                                               threshold=threshold)
      print(table)
  except (OSError, ValueError, KeyError) as e:
    error(f"--compare: {e}")
  return 1 if worse else 0


if __name__ == "__main__":
  sys.exit(main())
