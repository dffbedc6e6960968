"""Rollout tokens/s of the engine's fast modes against the standard engine, per workload.

Modes (`MODES`: one entry each; an entry names the parameter tree it samples
from and builds the engine it runs):

  standard      `RolloutEngine`: `decode_steps` tokens per call
  ngram         `SpeculativeEngine` with the n-gram (prompt lookup) drafter,
                which drafts on the device, --rounds verify rounds per call,
                and the default cost model: drafting turns off per request
                when its measured acceptance does not pay
  ngram_always  the same with verify_cost 1: every step with a draft verifies
  draft_model   `SpeculativeEngine` with a `DraftModel`: the policy's first
                --draft-layers layers (its embeddings and final norm too),
                reading a window of --window tokens, verify_cost 1; with
                --distill-steps, distilled on the policy's greedy outputs
                for other prompts of the same workloads first
                (`ptx.train.draft_distillation`; a `distill` line reports it)
  int8          `RolloutEngine` over `ptx.models.rollout_params` of the policy
                (int8 weight-only matrices): greedy tokens may differ from
                standard's where the policy's top two logits nearly tie
  int8_ngram    `ngram_always`'s engine over the int8 tree
  int8_kv       `int8` with int8 KV pages as well (`EngineConfig.kv_dtype`)
  pallas        `standard` with `attention_impl="pallas"`: the platform's Pallas
                paged kernel reads the pages in place (a GPU or TPU; on a CPU
                it refuses), where the other modes gather them

Workloads (token ids; the weights are random, so a draft is accepted where
the random policy's greedy tokens happen to repeat the context, as they do
in its loops: the acceptance printed is that of this model, not of a trained
one on such text):

  code_edit   a 160-token "file" (random ids), a separator, and its first 8
              tokens again: the output of an edit repeats the input
  arithmetic  word problems ("Ann has 17 apples and buys 25 more. ..."),
              bytes as ids

Every workload shares one engine configuration (room for its longest
prompt), so a mode compiles its programs once. Each (workload, mode) runs
twice, the first compiling; its JSON line gives the second run's tokens, wall
seconds, tokens/s, the drafted and accepted tokens, the engine programs the
timed run compiled (shapes the first run did not meet; 0 unless the runs
differ), and `same_as_standard`: the fraction of requests whose greedy tokens
equal the standard mode's (1.0 for speculation in float32; in bf16 the verify
forward's rounding differs from decoding's, and int8's shows how often its
rounding flips a greedy choice). The `calibrate` line measures the cost
model's verify_cost on this machine at these shapes: the time of a verify call (a run where every step
is one, with a drafter always wrong, so each emits one token per row) over
that of a decode step inside the standard engine's --decode-steps calls
(what a step that does not verify runs instead), same tokens.

    .venv/bin/python benchmarks/fast_mode.py --config smollm2 --requests 8 --new 64

`benchmarks/device_check.py --section fast` runs `measure` on a GPU in
bfloat16 compute (`--compute-dtype`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Callable

import jax
import numpy as np

from ptx.config import MeshConfig
from ptx.models import init_params
from ptx.models.llama import smollm2_135m
from ptx.models.rollout_params import rollout_params
from ptx.sampling import SamplingConfig
from ptx.sampling.engine import programs
from ptx.sampling.engine.drafters import DraftModel, NgramDrafter
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.speculative import SpeculativeConfig, SpeculativeEngine
from ptx.sharding import make_mesh
from ptx.train import draft_distillation

import sampling as sampling_bench  # benchmarks/ is the script's folder, first on sys.path

CONFIGS = {"tiny": sampling_bench.CFG, "smollm2": smollm2_135m()}
GREEDY = SamplingConfig(greedy=True)


class _AlwaysWrong:
  """Drafts k ids the policy rarely emits (3-5), so a verify call emits one token (the line counts those accepted)."""

  def propose(self, context, k):
    return [(context[-1] + 1) % 3 + 3] * k


@dataclasses.dataclass(frozen=True)
class Mode:
  """A fast-mode variant: the parameter tree it samples from ("float" or "int8") and its engine's builder."""
  tree: str
  engine: Callable[..., RolloutEngine]


def _ngram(cfg, config, args, verify_cost=None):
  speculative = SpeculativeConfig(drafts=args.drafts, rounds=args.rounds,
                                  **({} if verify_cost is None else {"verify_cost": verify_cost}))
  return SpeculativeEngine(cfg, config, sampling=GREEDY, drafter=NgramDrafter(), speculative=speculative)


MODES = {
    "standard": Mode("float", lambda cfg, config, args: RolloutEngine(cfg, config, sampling=GREEDY)),
    "ngram": Mode("float", _ngram),
    "ngram_always": Mode("float", lambda cfg, config, args: _ngram(cfg, config, args, verify_cost=1.0)),
    "draft_model": Mode("float", lambda cfg, config, args: SpeculativeEngine(
        cfg, config, sampling=GREEDY, drafter=DraftModel(args.draft_params, args.draft_cfg, window=args.window),
        speculative=SpeculativeConfig(drafts=args.drafts, verify_cost=1.0))),
    "int8": Mode("int8", lambda cfg, config, args: RolloutEngine(cfg, config, sampling=GREEDY)),
    "int8_ngram": Mode("int8", lambda cfg, config, args: _ngram(cfg, config, args, verify_cost=1.0)),
    "int8_kv": Mode("int8", lambda cfg, config, args: RolloutEngine(
        cfg, dataclasses.replace(config, kv_dtype="int8"), sampling=GREEDY)),
    "pallas": Mode("float", lambda cfg, config, args: RolloutEngine(
        dataclasses.replace(cfg, attention_impl="pallas"), config, sampling=GREEDY)),
}


def code_edit(n: int, vocab: int, rng: np.random.Generator) -> list[list[int]]:
  """Prompts whose continuation repeats them: a random file, a separator, and the file's first tokens again."""
  files = [rng.integers(3, vocab, 160).tolist() for _ in range(n)]
  return [[1] + f + [2] + f[:8] for f in files]


def arithmetic(n: int, vocab: int, rng: np.random.Generator) -> list[list[int]]:
  """Word problems as byte ids (+3, past the special ids)."""
  names, items = ["Ann", "Bob", "Chen", "Dara"], ["apples", "books", "coins", "shells"]
  texts = [f"{rng.choice(names)} has {rng.integers(2, 99)} {item} and buys {rng.integers(2, 99)} more. "
           f"Then {rng.integers(2, 9)} friends each give {rng.integers(2, 20)} {item}. How many {item} now? Answer:"
           for item in rng.choice(items, n)]
  return [[1] + [b + 3 for b in t.encode()] for t in texts]


WORKLOADS = {"code_edit": code_edit, "arithmetic": arithmetic}


def engine_config(prompts: list[list[int]], args) -> EngineConfig:
  """Room for every request at once and for the longest of `prompts`, so each mode compiles one set of programs."""
  seq_len = max(map(len, prompts)) + args.new
  pages_per_seq = -(-seq_len // args.page_size)
  return EngineConfig(max_seqs=args.requests, pages=args.requests * pages_per_seq + 1, page_size=args.page_size,
                      max_seq_len=seq_len, decode_steps=args.decode_steps, prefill_chunk=256,
                      prefill_rows=args.requests)


def _compiled() -> int:
  """Programs the engines' jitted functions have compiled so far (a timed run should add none)."""
  return programs.SHARED.compiled


def run(engine_of, params, prompts: list[list[int]], new: int) -> dict:
  """Runs `prompts` through a fresh engine twice (the first compiles); the second run's figures."""
  def once():
    engine = engine_of()
    for p in prompts:
      engine.submit(p, max_new_tokens=new)
    start = time.perf_counter()
    done = engine.run(params)
    return time.perf_counter() - start, [done[i] for i in sorted(done)]

  first, _ = once()
  compiled = _compiled()
  wall, done = once()
  tokens = sum(len(c.tokens) for c in done)
  drafted, accepted = sum(c.drafted for c in done), sum(c.accepted for c in done)
  return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
          "compile_s": round(first - wall, 1), "drafted": drafted, "accepted": accepted,
          "acceptance": round(accepted / drafted, 3) if drafted else None,
          "compiled_in_timed_run": _compiled() - compiled,
          "outputs": [tuple(c.tokens) for c in done]}


def measure(cfg, params, args):
  """Yields one row per (workload, mode), then the calibration row (module docstring).

  Args:
    cfg: the policy's config.
    params: its parameters.
    args: `main`'s options (workloads, modes, requests, new, drafts, decode_steps, page_size, draft_layers,
      window, seed).
  """
  args.draft_cfg, args.draft_params = draft_distillation.cut(params, cfg, args.draft_layers)
  if args.distill_steps:  # on other prompts of the same workloads (seed + 1), sampled as the modes decode: greedily
    prompts = [p for name in args.workloads.split(",")
               for p in WORKLOADS[name](args.distill_prompts, cfg.vocab_size, np.random.default_rng(args.seed + 1))]
    d = draft_distillation.Distillation(samples=1, max_new_tokens=args.new, sampling=GREEDY, steps=args.distill_steps,
                                        batch_size=8, seed=args.seed)
    args.draft_params, losses = draft_distillation.distill(params, cfg, args.draft_cfg, args.draft_params, prompts,
                                                           d, make_mesh(MeshConfig()))
    yield {"workload": "distill", "prompts": len(prompts), "steps": args.distill_steps,
           "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4), "load": os.getloadavg()[0]}
  modes = args.modes.split(",")
  trees = {"float": params}
  if any(MODES[m].tree == "int8" for m in modes):
    trees["int8"] = jax.jit(rollout_params, static_argnames="cfg")(params, cfg=cfg)
  workloads = {name: WORKLOADS[name](args.requests, cfg.vocab_size, np.random.default_rng(args.seed))
               for name in args.workloads.split(",")}
  config = engine_config([p for prompts in workloads.values() for p in prompts], args)
  common = {"config": args.config, "compute_dtype": cfg.compute_dtype, "requests": args.requests, "new": args.new,
            "drafts": args.drafts, "rounds": args.rounds}
  for name, prompts in workloads.items():
    standard = None
    for mode in modes:
      record = run(lambda: MODES[mode].engine(cfg, config, args), trees[MODES[mode].tree], prompts, args.new)
      outputs = record.pop("outputs")
      standard = outputs if mode == "standard" else standard
      same = None if standard is None else round(sum(a == b for a, b in zip(outputs, standard)) / len(outputs), 3)
      yield {"workload": name, "mode": mode, "params": MODES[mode].tree, **common, **record,
             "same_as_standard": same, "load": os.getloadavg()[0]}
  prompts = next(iter(workloads.values()))
  verify = run(lambda: SpeculativeEngine(cfg, config, sampling=GREEDY, drafter=_AlwaysWrong(), speculative=(
      SpeculativeConfig(drafts=args.drafts, verify_cost=1.0, min_verifies=10 ** 9))), params, prompts, args.new)
  decode = run(lambda: RolloutEngine(cfg, config, sampling=GREEDY), params, prompts, args.new)
  yield {"workload": "calibrate", **common, "verify_call_s": verify["wall_s"] / args.new,
         "decode_step_s": decode["wall_s"] / args.new, "verify_cost": round(verify["wall_s"] / decode["wall_s"], 2),
         "verify_accepted": verify["accepted"], "load": os.getloadavg()[0]}


def parser() -> argparse.ArgumentParser:
  """The script's options; `device_check` parses its own list with them."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="smollm2", choices=sorted(CONFIGS))
  p.add_argument("--compute-dtype", default=None, help="the model's compute dtype (default: the config's)")
  p.add_argument("--workloads", default="code_edit,arithmetic")
  p.add_argument("--modes", default=",".join(m for m in MODES if m != "pallas" or jax.default_backend() != "cpu"),
                 help="comma-separated; default: every mode this backend runs (pallas needs a GPU or TPU)")
  p.add_argument("--requests", type=int, default=8)
  p.add_argument("--new", type=int, default=64, help="tokens each request generates")
  p.add_argument("--drafts", type=int, default=4, help="SpeculativeConfig.drafts")
  p.add_argument("--rounds", type=int, default=SpeculativeConfig.rounds,
                 help="SpeculativeConfig.rounds: n-gram verify rounds per device call")
  p.add_argument("--decode-steps", type=int, default=16)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--draft-layers", type=int, default=2, help="the draft model's layers (the policy's first ones)")
  p.add_argument("--window", type=int, default=64, help="DraftModel.window")
  p.add_argument("--distill-steps", type=int, default=0,
                 help="train the draft model this many SFT steps on the policy's greedy samples (0: the cut as is)")
  p.add_argument("--distill-prompts", type=int, default=64, help="prompts per workload to distil on (seed + 1)")
  p.add_argument("--seed", type=int, default=0)
  return p


def model(args):
  """(config, random parameters) of --config in --compute-dtype."""
  cfg = CONFIGS[args.config]
  if args.compute_dtype:
    cfg = dataclasses.replace(cfg, compute_dtype=args.compute_dtype)
  return cfg, init_params(cfg, jax.random.key(args.seed))


def main() -> None:
  """Prints one JSON line per (workload, mode), then the calibration line."""
  args = parser().parse_args()
  if unknown := set(args.modes.split(",")) - set(MODES):
    raise SystemExit(f"--modes: unknown {sorted(unknown)}; known: {sorted(MODES)}")
  for row in measure(*model(args), args):
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
