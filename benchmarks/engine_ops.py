"""Where one decode call of the rollout engine spends its time, by kind of compiled operation.

An engine (`ptx.sampling.engine.engine`, random weights) is filled with --rows
sequences and decoded until their cached lengths reach --length (rounded up
to whole calls); the next --calls decode calls run under `jax.profiler`
(after the same calls on an identical engine, which compile their
programs), and the trace's operations are summed by kind: the op name
without its numeric suffix (`gather_bitcast_fusion.2` and
`gather_bitcast_fusion` are one kind). Spans that hold others (a while
loop's, the executor's) are left out: their operations count on their own.
On CPU, XLA runs operations on its client and Eigen threads, so a kind's
milliseconds are summed over threads; on a GPU they are the device plane's
"XLA Ops" line (not yet run on one). The profiler slows a call (about 2x on
CPU): the shares, not the absolute times, are what a run says.

One JSON line per kind (milliseconds per call, operations per call, share of
the summed time), largest first, then a summary line.

    .venv/bin/python benchmarks/engine_ops.py --config smollm2 --rows 64 --length 512 --page-size 64
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import tempfile
import time

import jax
import numpy as np
from jax.profiler import ProfileData

from ptx.models import init_params
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig

import rollout  # benchmarks/ is the script's folder, first on sys.path

PROMPT_LEN = rollout.PROMPT_LEN
NOT_OPERATIONS = ("end: ", "ThunkExecutor", "Threadpool", "SlinkyThreadPool")


def device_ops(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
  """Milliseconds and counts of the compiled operations in the trace under `trace_dir`, by kind."""
  files = sorted(pathlib.Path(trace_dir).rglob("*.xplane.pb"))
  if not files:
    raise SystemExit(f"no profile was written under {trace_dir}")
  ms, count = collections.Counter(), collections.Counter()
  for plane in ProfileData.from_file(str(files[-1])).planes:
    for line in plane.lines:
      on_device = plane.name.startswith("/device:") and line.name == "XLA Ops"
      if not (on_device or line.name.startswith("tf_XLA")):  # XLA:CPU runs operations on its client and pool threads
        continue
      # The executor's and the thread pool's own spans and markers are not operations.
      events = sorted((e for e in line.events if not e.name.startswith(NOT_OPERATIONS)),
                      key=lambda e: (e.start_ns, -e.duration_ns))
      for event, after in zip(events, events[1:] + [None]):
        if after is not None and after.start_ns < event.end_ns:  # a while loop's or conditional's span: its
          continue  # operations count on their own
        kind = re.sub(r"[.\d]+$", "", event.name)
        ms[kind] += event.duration_ns / 1e6
        count[kind] += 1
  return ms, count


def main() -> None:
  """Fills an engine to --length, profiles --calls decode calls, prints one line per kind and a summary."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="tiny", choices=sorted(rollout.CONFIGS))
  p.add_argument("--rows", type=int, default=64)
  p.add_argument("--length", type=int, default=256, help="cached positions of every row when profiling starts, at "
                 "least (rounded up to a whole number of calls)")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--decode-steps", type=int, default=16)
  p.add_argument("--calls", type=int, default=1)
  p.add_argument("--top", type=int, default=20, help="kinds printed (the summary counts all)")
  args = p.parse_args()
  if args.length < PROMPT_LEN:
    raise SystemExit(f"--length must be >= the prompt's {PROMPT_LEN} tokens, got {args.length}")
  cfg = rollout.CONFIGS[args.config]
  params = init_params(cfg, jax.random.key(0))
  calls_before = -(-(args.length - PROMPT_LEN + 1) // args.decode_steps)
  budget = (calls_before + args.calls) * args.decode_steps
  pages_per_row = -(-(PROMPT_LEN + budget) // args.page_size)
  config = EngineConfig(max_seqs=args.rows, pages=args.rows * pages_per_row + 1, page_size=args.page_size,
                        max_seq_len=PROMPT_LEN + budget, decode_steps=args.decode_steps, prefill_chunk=PROMPT_LEN,
                        prefill_rows=min(args.rows, 16))

  def filled() -> RolloutEngine:
    """An engine whose rows (no stop ids: all decode every step) have cached PROMPT_LEN - 1 + calls_before * steps."""
    engine = RolloutEngine(cfg, config)
    for prompt in rollout.random_prompts(args.rows, vocab_size=cfg.vocab_size, rng=np.random.default_rng(0)):
      engine.submit(prompt, max_new_tokens=budget)
    for _ in range(calls_before):
      engine.step(params)
    return engine

  engine = filled()
  for _ in range(args.calls):  # compiles the programs of the calls profiled below, which have the same shapes
    engine.step(params)
  engine = filled()
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      start = time.perf_counter()
      for _ in range(args.calls):
        engine.step(params)
      wall = time.perf_counter() - start
    ms, count = device_ops(trace_dir)
  total = sum(ms.values())
  base = {"config": args.config, "backend": jax.default_backend(), "rows": args.rows,
          "length_at_start": PROMPT_LEN - 1 + calls_before * args.decode_steps,
          "page_size": args.page_size, "decode_steps": args.decode_steps}
  for kind, value in ms.most_common(args.top):
    print(json.dumps({**base, "kind": kind, "ms_per_call": round(value / args.calls, 2),
                      "ops_per_call": count[kind] // args.calls, "share": round(value / total, 3)}))
  print(json.dumps({**base, "summary": True, "calls": args.calls, "wall_ms_per_call": round(1e3 * wall / args.calls, 1),
                    "op_ms_per_call": round(total / args.calls, 1), "kinds": len(ms)}))


if __name__ == "__main__":
  main()
