"""`ptx eval`: a model's pass@k (or log-likelihood scores) on held-out suites, or the comparison of two reports.

The suites are evaluated as `--eval.suites` evaluates them at a run's checkpoints (`ptx.train.checkpoint_evals`),
so a report of this command and one of a run compare.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from ptx import env_flags
from ptx import paths

def add_command(sub) -> None:
  """Adds `ptx eval` and its flags to the subparsers `sub`."""
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
                  "trains on), math, code, exact (prompts as written); questions about an image (image chat records): "
                  "visual_counting, visual_clock, visual_bar_chart, visual_table, visual_grid, visual_digit_sums "
                  "(handwritten digits, the digits extra); multi-turn, played as episodes: calculator "
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


def run(args, overrides: list[str], error) -> int:
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
                         answer_match=args.answer_match, families=env_flags.families(args.families))
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

