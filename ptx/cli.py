"""The `ptx` command line: `ptx version`, `ptx demo`, `ptx sft`, `ptx dpo`, `ptx grpo`, `ptx eval`, `ptx convert`.

Every job takes `--out DIR`, an optional `--config FILE` (a JSON config tree,
such as a run's saved config.json) and overrides `--section.field=value`
applied after it (`--model=PRESET` swaps in a registered model preset).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import ptx

_ALGORITHMS = {"sft": "SFT on prompt/completion or chat records",
               "dpo": "preference optimisation (DPO, cDPO, IPO, hinge, SimPO) on chosen/rejected records",
               "grpo": "GRPO-family RL (--grpo=grpo|dapo|dr_grpo|gspo|rloo|grpo_paper) on built-in arithmetic "
                       "or on rl records"}
# `ptx grpo --env`: single-turn environments that score rl records on the host.
_ENVIRONMENTS = ("exact_answer", "code")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="ptx", description="Post-training for LLMs in JAX: SFT, DPO and GRPO in one SPMD program.",
      epilog="Config overrides: --model=PRESET, --model.d_model=256, --train.steps=100, ... Compiled programs are "
             "cached in ~/.cache/ptx/jax (PTX_COMPILATION_CACHE=DIR moves it, =off turns it off).")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  sub.add_parser("version", help="print the ptx, jax and flax versions")
  demo = sub.add_parser("demo", help="SFT a tiny model on built-in arithmetic; before/after exact match",
                        description="Train the tiny preset by SFT on 2-digit addition and report held-out "
                        "exact match before and after. Accepts config overrides, e.g. --train.steps=100.")
  _job_arguments(demo, default_out="out/demo")
  demo.add_argument("--rl-steps", type=int, default=400, help="GRPO steps after SFT")
  convert = sub.add_parser("convert", help="convert a checkpoint into a Hugging Face directory")
  convert.add_argument("format", choices=["gguf"], help="source format")
  convert.add_argument("src", type=pathlib.Path, help="source file (e.g. model.gguf)")
  convert.add_argument("dst", type=pathlib.Path, help="HF directory to write (weights, config, tokenizer)")
  convert.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="stored dtype")
  ev = sub.add_parser("eval", help="pass@k of a model on an evaluation suite, or compare two reports",
                      description="Sample k completions per task, score them in the suite's environment and "
                      "write OUT/eval.json (pass@k, mean@k, outcome counts); or --compare two reports.")
  ev.add_argument("--model", type=pathlib.Path, help="Hugging Face model directory (weights and tokenizer)")
  ev.add_argument("--task", help="suite name: arithmetic, countdown, needle (long-context retrieval), math, code, "
                  "shell")
  ev.add_argument("--tasks-file", type=pathlib.Path, help="JSONL task records for the file suites")
  ev.add_argument("--n", type=int, default=100, help="number of tasks")
  ev.add_argument("--k", type=int, default=8, help="samples per task")
  ev.add_argument("--max-new-tokens", type=int, default=256)
  ev.add_argument("--temperature", type=float, default=1.0, help="0 samples greedily")
  ev.add_argument("--chat", action="store_true", help="render prompts through the model's chat template")
  ev.add_argument("--seed", type=int, default=0)
  ev.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/eval"), help="report directory")
  ev.add_argument("--compare", nargs=2, type=pathlib.Path, metavar=("A.json", "B.json"),
                  help="print the regression table of report B against report A")
  for name, help_text in _ALGORITHMS.items():
    job = sub.add_parser(name, help=help_text, description=f"{help_text}. Data: --data.train_files='[\"a.jsonl\"]'.")
    job.add_argument("--config", type=pathlib.Path, help="JSON config file (e.g. a saved config.json)")
    _job_arguments(job, default_out=f"out/{name}")
    job.add_argument("--no-export", action="store_true",
                     help="skip writing OUT/hf (HF weights + tokenizer; with LoRA also OUT/adapter in PEFT layout)")
    if name == "grpo":
      job.description += (" Without --data.train_files: 2-digit addition, exact match scored in-graph (fused "
                          "mode; data.batch_size prompts of data.seq_len tokens, grpo.max_response_tokens new). "
                          "With them: rl records scored on the host by --env (host-reward mode).")
      job.add_argument("--env", choices=_ENVIRONMENTS, default="exact_answer",
                       help="environment scoring rl records: exact_answer (final answer, as math) or code "
                       "(unit tests in the sandbox)")
  return parser


def _job_arguments(parser: argparse.ArgumentParser, default_out: str) -> None:
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(default_out), help="run directory")
  parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
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
      print(convert_gguf(args.src, args.dst, dtype=args.dtype))
    except (GGUFError, OSError) as e:
      parser.error(str(e))
    return 0
  from ptx import compile_cache

  compile_cache.enable()  # before anything compiles
  if args.command == "eval":
    if overrides:
      parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    return _evaluate(args, parser.error)
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
  from ptx import demo

  try:
    if args.command == "demo":
      cfg = config_lib.apply_overrides(demo.default_config(), overrides)
    else:
      base = config_lib.Config() if args.command != "grpo" else _grpo_default_config()
      if args.config is not None:
        base = config_lib.from_dict(config_lib.Config, json.loads(args.config.read_text()))
      cfg = config_lib.apply_overrides(base, overrides)
  except (config_lib.ConfigError, OSError, json.JSONDecodeError) as e:
    parser.error(str(e))
  progress = not args.no_progress and sys.stderr.isatty()
  if args.command == "demo":
    demo.run(cfg, args.out, rl_steps=args.rl_steps, resume=args.resume, progress=progress)
  elif args.command == "grpo":
    _grpo(cfg, args, progress=progress, error=parser.error)
  else:
    _train(args.command, cfg, args, progress=progress, error=parser.error)
  return 0


def _train(algorithm: str, cfg, args, *, progress: bool, error) -> None:
  """Builds the data pipeline and loss for `algorithm`, runs the training loop and exports the model."""
  import dataclasses

  import jax

  from ptx.algorithms import dpo, sft
  from ptx.data.hf_tokenizer import load_tokenizer
  from ptx.data.pipeline import make_pipeline
  from ptx.data.sources import JsonlSource
  from ptx.data.tokenizer import ByteTokenizer
  from ptx.train.loop import fit

  if not cfg.data.train_files:
    error(f"ptx {algorithm}: set --data.train_files='[\"train.jsonl\"]'")
  kind = {"sft": "sft", "dpo": "preference"}[algorithm]
  data_cfg = dataclasses.replace(cfg.data, kind=kind, pack=cfg.data.pack and kind == "sft")
  cfg = dataclasses.replace(cfg, data=data_cfg)
  tokenizer = ByteTokenizer() if data_cfg.tokenizer == "byte" else load_tokenizer(data_cfg.tokenizer)
  if cfg.model.vocab_size < tokenizer.vocab_size:
    error(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
  pipeline = functools.partial(make_pipeline, tokenizer=tokenizer, process_index=jax.process_index(),
                               process_count=jax.process_count())
  sources = {"train": JsonlSource(data_cfg.train_files)}
  train = pipeline(sources["train"], cfg=data_cfg)
  evaluation = None
  if data_cfg.eval_files:
    sources["eval"] = JsonlSource(data_cfg.eval_files)
    evaluation = pipeline(sources["eval"], cfg=dataclasses.replace(data_cfg, shuffle=False, num_epochs=1))
  prepare = None
  if algorithm == "sft":
    loss_fn = functools.partial(sft.loss, model=cfg.model)
  else:
    loss_fn = functools.partial(dpo.loss, model=cfg.model, dpo=cfg.dpo)
    if cfg.dpo.loss_type != "simpo" and cfg.dpo.reference == "frozen":
      prepare = functools.partial(dpo.prepare, model=cfg.model)
    elif cfg.dpo.loss_type != "simpo":  # one pass now; training then keeps no reference copy
      from ptx.train.reference_pass import with_reference_table

      table = functools.partial(with_reference_table, pipeline=pipeline, cfg=cfg)
      train = table(train, source=sources["train"], path=args.out / "reference_logps" / "train.npy")
      if evaluation is not None:
        evaluation = table(evaluation, source=sources["eval"], path=args.out / "reference_logps" / "eval.npy")
  state, summary = fit(cfg, loss_fn=loss_fn, train_data=train, out=args.out, resume=args.resume,
                       eval_data=None if evaluation is None else list(evaluation), prepare=prepare, progress=progress)
  _export(state, cfg, args, summary, tokenizer)


def _export(state, cfg, args, summary: dict, tokenizer) -> None:
  """OUT/hf (and OUT/adapter under LoRA) after a finished run; a preempted run has nothing final to export."""
  if args.no_export or summary["preempted"]:
    return
  from ptx.train.export import export_hf

  written = export_hf(state, cfg, args.out, tokenizer)
  print(json.dumps({"exported": {k: str(v) for k, v in written.items()}}), flush=True)


def _grpo_default_config():
  """`ptx grpo`'s defaults: the demo's GRPO stage (tiny preset, 2-digit addition, its optimizer and group size)."""
  import dataclasses

  from ptx import demo
  from ptx.config import DataConfig, TrainConfig

  cfg = demo.default_config()
  return dataclasses.replace(
      cfg, optim=demo.RL_OPTIM, train=TrainConfig(steps=150, log_every=10, checkpoint_every=50, eval_every=10**9),
      data=DataConfig(kind="rl", batch_size=demo.RL_PROMPTS, seq_len=demo.PROMPT_LEN, pack=False))


def _grpo(cfg, args, *, progress: bool, error) -> None:
  """`ptx grpo`: the fused step on built-in arithmetic, or the host-reward step on rl records."""
  import dataclasses

  from ptx import demo
  from ptx.data.arithmetic import ArithmeticTask
  from ptx.data.hf_tokenizer import load_tokenizer
  from ptx.data.tokenizer import ByteTokenizer
  from ptx.rl import token_rewards
  from ptx.rl.prompt_batches import JsonlTasks, PromptBatches
  from ptx.train import rl_host, rl_step
  from ptx.train.loop import fit

  data = dataclasses.replace(cfg.data, kind="rl", pack=False)
  cfg = dataclasses.replace(cfg, data=data)
  tokenizer = ByteTokenizer() if data.tokenizer == "byte" else load_tokenizer(data.tokenizer)
  if cfg.model.vocab_size < tokenizer.vocab_size:
    error(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
  if data.batch_size % cfg.grpo.minibatches:
    error(f"grpo.minibatches={cfg.grpo.minibatches} must divide data.batch_size={data.batch_size} (the prompts "
          "of a step, each a group)")
  lora = cfg.lora if cfg.lora.rank > 0 else None
  common = dict(model=cfg.model, max_new_tokens=cfg.grpo.max_response_tokens,
                stop_ids=(tokenizer.eos_id,), pad_id=tokenizer.pad_id, grad_accum=cfg.train.grad_accum, lora=lora)
  batches = functools.partial(PromptBatches, tokenizer=tokenizer, prompt_len=data.seq_len)
  if not data.train_files:
    rounds = 1 + (cfg.grpo.max_refill_rounds if cfg.grpo.filter_groups == "refill" else 0)
    prompts = batches(ArithmeticTask(demo.RL_SEED, demo.MAX_DIGITS), batch_size=data.batch_size * rounds,
                      answer_width=cfg.grpo.max_response_tokens)
    make_step = functools.partial(rl_step.make_grpo_step, cfg=cfg.grpo, reward_fn=token_rewards.target_reward,
                                  **common)
  else:
    from ptx.rl.environments.exact_answer import ExactAnswerEnv
    from ptx.rl.environments.python_tests import PythonTestsEnv

    env, fields = {"exact_answer": (ExactAnswerEnv, ("answer",)), "code": (PythonTestsEnv, ("tests",))}[args.env]
    try:
      prompts = rl_host.Lookahead(batches(JsonlTasks(data.train_files, data.task_fields or fields),
                                          batch_size=data.batch_size, answer_width=None))
    except (OSError, ValueError) as e:
      error(str(e))
    reward = rl_host.env_reward(env(), tokenizer, (tokenizer.eos_id,), cfg.grpo.group_size)
    make_step = functools.partial(rl_host.HostRewardStep, spec=rl_step.RLSpec(grpo=cfg.grpo, **common),
                                  reward=reward, prompts=prompts)
  state, summary = fit(cfg, train_data=prompts, out=args.out, resume=args.resume, make_step=make_step,
                       with_reference=cfg.grpo.beta > 0 and cfg.grpo.kl_placement != "none", progress=progress,
                       optimizer_stage=rl_step.coefficient_stage(cfg.grpo), updates_per_step=cfg.grpo.updates_per_step)
  _export(state, cfg, args, summary, tokenizer)


def _evaluate(args, error) -> int:
  """`ptx eval`: one suite's report for one model, or the comparison of two reports."""
  from ptx.rl import evaluation

  if args.compare:
    try:
      print(evaluation.compare(evaluation.read_report(args.compare[0]), evaluation.read_report(args.compare[1])))
    except (OSError, ValueError, KeyError) as e:
      error(f"--compare: {e}")
    return 0
  if args.model is None or args.task is None:
    error("ptx eval needs --model DIR and --task NAME (or --compare A.json B.json)")
  from ptx.data.hf_tokenizer import load_tokenizer
  from ptx.models import load_hf
  from ptx.rl import suites
  from ptx.sampling.rules import SamplingConfig
  from ptx.sampling.text import TextSampler

  try:
    env, tasks = suites.load(args.task, n=args.n, seed=args.seed, path=args.tasks_file)
    model, tokenizer = load_hf(args.model), load_tokenizer(args.model)
  except (OSError, ValueError) as e:
    error(str(e))
  sampler = TextSampler(model.params, model.cfg, tokenizer, max_new_tokens=args.max_new_tokens,
                        sampling=SamplingConfig(greedy=True) if args.temperature == 0 else
                        SamplingConfig(temperature=args.temperature), seed=args.seed, chat=args.chat)
  report = evaluation.evaluate(sampler, env, tasks, k=args.k)
  if args.task == "needle":  # long-context retrieval is read per (haystack length, needle depth) cell
    from ptx.rl.environments import needle

    report["cells"] = needle.cells(report, tasks)
  args.out.mkdir(parents=True, exist_ok=True)
  evaluation.write_report(report, args.out / "eval.json")
  print(json.dumps({k: v for k, v in report.items() if not isinstance(v, list)}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
