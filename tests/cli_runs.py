"""Runs of `ptx` commands for the CLI and training-loop tests: their inputs, metrics, checkpoints and exit codes."""

import json
import os
import pathlib
import shutil
import time

import orbax.checkpoint as ocp

from ptx import cli

# The `ptx sft` runs of tests/test_cli.py, tests/test_fault_injection.py and tests/train/test_loop.py: one model,
# batch and schedule (a 1-layer tiny model, 8 rows of 32 tokens over data=2 x fsdp=4, 6 steps), so their programs
# are the same and the suite's persistent compile cache compiles them once for all three files.
SFT_STEPS = 6
SFT = ["--no-progress", "--model=tiny", "--model.n_layers=1", "--model.d_model=64", "--model.mlp_dim=128",
       f"--train.steps={SFT_STEPS}", "--train.log_every=1", "--train.checkpoint_every=2", "--train.keep_checkpoints=5",
       "--data.batch_size=8", "--data.seq_len=32", "--data.num_bins=4", "--mesh.data=2", "--mesh.fsdp=4"]
# Metrics that depend on timing, so differ between any two runs: rates and timings of the wall clock, and how many
# records the data pipeline had read ahead by the time a step was logged.
TIMING = ("steps_per_s", "samples_per_s", "tokens_per_s", "timing_s/", "perf/", "data/read")


def write_jsonl(path: pathlib.Path, rows) -> pathlib.Path:
  """Writes `rows` as JSON lines to `path`; returns `path`."""
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def files_flag(section: str, *paths) -> str:
  """The override `--data.SECTION=["PATH", ...]` (SECTION: train_files or eval_files)."""
  return f"--data.{section}={json.dumps([str(p) for p in paths])}"


def metrics(out: pathlib.Path) -> list[dict]:
  """The records of `out`/metrics.jsonl, in order."""
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def by_step(out: pathlib.Path) -> dict[int, dict]:
  """The training records of `out`/metrics.jsonl by step (the lines of evaluations, which have no loss, left out)."""
  return {r["step"]: r for r in metrics(out) if "loss" in r}


def without_timing(record: dict) -> dict:
  """`record` less the metrics that depend on timing, which no two runs share."""
  return {k: v for k, v in record.items() if not k.startswith(TIMING)}


def exit_code(argv: list[str]) -> int:
  """The exit code of `ptx ARGV` run in this process (2 for a refusal, whether argparse's or the run's)."""
  try:
    return cli.main(argv)
  except SystemExit as e:
    return e.code


def cut_after(full: pathlib.Path, cut: pathlib.Path, step: int) -> pathlib.Path:
  """A copy of the finished run `full` at `cut`, as if killed right after checkpoint `step` was published."""
  shutil.copytree(full, cut)
  for path in (cut / "checkpoints").iterdir():
    if path.name.isdigit() and int(path.name) > step:
      shutil.rmtree(path)
  lines = (cut / "metrics.jsonl").read_text().splitlines()
  (cut / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= step))
  return cut


def checkpoint_params(out: pathlib.Path, step: int):
  """The parameters saved in `out`'s checkpoint of `step`, as host arrays."""
  return ocp.StandardCheckpointer().restore((out / "checkpoints" / str(step) / "state").absolute())["params"]


def summary(stdout: str) -> dict:
  """The run summary a `ptx sft|dpo|grpo` command printed."""
  return json.loads(next(l for l in stdout.splitlines() if l.startswith('{"summary"')))["summary"]


def signalling_step(run, out: pathlib.Path, *, at: int, wait: int, signum: int):
  """`JittedStep.__call__` (`run`) that sends this process `signum` as step `at` begins, once checkpoint `wait` of
  the run in `out` is published (saves are asynchronous: a run killed before then has nothing to resume)."""
  def signalled(self, state, batch):
    if int(state.step) + 1 == at:
      while not (out / "checkpoints" / str(wait)).is_dir():
        time.sleep(0.01)  # Orbax renames the step's directory into place when the save is complete
      os.kill(os.getpid(), signum)
    return run(self, state, batch)

  return signalled
