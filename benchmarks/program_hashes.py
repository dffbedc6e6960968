"""Fingerprints of the compiled training programs, to show that a refactor left them unchanged.

Compiles one step of each toy job (`ptx.train.presets.TOY`: SFT, fused GRPO,
host-reward GRPO's sampling and update programs) on one CPU device, as
`ptx.train.loop.fit` builds it, and prints one JSON line per program: the
SHA-256 of its optimised HLO text with the source locations taken out
(`canonical`: the file and function tables, stack frame ids and op metadata
name the Python files that traced it, which a move renames). Equal hashes on
two commits mean XLA compiled the same programs. `--out DIR` also writes each
program's canonical text there, for a diff when the hashes differ.

    .venv/bin/python benchmarks/program_hashes.py --out /tmp/before
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re

# Sections of an HLO module's text that list source files, functions and stack frames, one entry a line.
_SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def canonical(hlo: str) -> str:
  """`hlo` without what names the Python source: the source tables, stack frame ids, op metadata, module name."""
  lines, skipping = [], False
  for line in hlo.split("\n"):
    if line in _SOURCE_TABLES:
      skipping = True
      continue
    if skipping and (line.startswith("%") or line.startswith("ENTRY")):
      skipping = False
    if not skipping:
      lines.append(line)
  text = re.sub(r", stack_frame_id=\d+", "", "\n".join(lines))
  text = re.sub(r",? metadata=\{[^}]*\}", "", text)
  return re.sub(r"^HloModule \S+", "HloModule", text, flags=re.M)


def _programs():
  """(job name, program name, compiled program) of each toy job's step."""
  import jax
  import numpy as np

  import ptx
  from ptx import sharding
  from ptx.data.global_batch import to_global
  from ptx.data.tokenizer import ByteTokenizer
  from ptx.train import pod_fit
  from ptx.train.presets import TOY
  from ptx.train.state import abstract_state, init_state, state_shardings

  tokenizer = ByteTokenizer()
  zero_reward = lambda tokens, lengths, tasks: np.zeros(len(lengths), np.float32)  # noqa: E731
  builders = {"sft": (TOY["sft"], ptx.sft_job), "grpo": (TOY["grpo"], ptx.grpo_job),
              "grpo_host": (TOY["grpo"], lambda cfg, tok: ptx.grpo_host_job(cfg, tok, zero_reward))}
  for name, (preset, build) in builders.items():
    cfg = preset()
    job = build(cfg, tokenizer)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    optimizer = job.optimizer()
    shardings = state_shardings(job.model, optimizer, mesh, job.rules, with_reference=job.with_reference,
                                lora=job.lora)
    start = lambda: init_state(job.model, optimizer, cfg.train.seed, mesh, job.rules,  # noqa: E731
                               with_reference=job.with_reference, lora=job.lora)
    state = abstract_state(shardings, start)
    data = job.step.stream(iter(pod_fit.host_batches(cfg, job)))
    step = job.step.build(optimizer, mesh, shardings, data)
    for program, compiled in step.compile(state, to_global(next(data), mesh, job.rules)).items():
      yield name, program, compiled


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", type=pathlib.Path, help="write each program's canonical HLO text here")
  args = parser.parse_args()
  for job, program, compiled in _programs():
    text = canonical(compiled.as_text())
    if args.out:
      args.out.mkdir(parents=True, exist_ok=True)
      (args.out / f"{job}.{program}.hlo").write_text(text)
    print(json.dumps({"job": job, "program": program, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                      "chars": len(text)}), flush=True)


if __name__ == "__main__":
  main()
