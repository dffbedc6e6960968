"""Int8 rollouts: decode tokens/s of the rollout engine with float vs int8 weight-only parameters, and the log-prob gap.

Parameters (`--params`): `float`, the training tree as it is (float32 on this config), and `int8`,
`ptx.models.rollout_params.rollout_params` of it.

Each runs the same requests (--prompts prompts x --samples samples, --new-tokens each, no stop id: every row
decodes its whole budget) through a fresh `RolloutEngine` per run, the first run compiling; `tokens_per_s` is
the generated tokens over a timed run's wall seconds (--rounds of them per tree, the trees alternating; the
summary gives each tree's median and best round). Sampling draws the same uniforms for both trees (same seed).
For the int8 tree, the float policy rescores the sampled tokens (`forward`, as GRPO recomputes its old
log-probs) and `ptx.train.grpo.metrics.logprob_gap` gives the gap; `same_prefix_tokens` is how many tokens a
row samples before it first departs from the float tree's. `param_bytes` is the tree's size. One JSON line
per tree and round, then a summary.

    .venv/bin/python benchmarks/quantized_rollout.py --config smollm2 [--model-dir HF_DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ptx.models import init_params, load_hf
from ptx.models.decoder import forward, token_log_probs
from ptx.models.llama import smollm2_135m, tiny
from ptx.models.rollout_params import rollout_params
from ptx.sampling import SamplingConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig
from ptx.train.grpo.metrics import logprob_gap

CONFIGS = {"tiny": tiny, "smollm2": smollm2_135m}
PARAMS = ("float", "int8")


def requests(cfg, args) -> list[list[int]]:
  """--prompts prompts of --prompt-len ids drawn from [3, V) (BOS 1 first), the same for every tree."""
  rng = np.random.default_rng(args.seed)
  return [[1] + rng.integers(3, cfg.vocab_size, args.prompt_len - 1).tolist() for _ in range(args.prompts)]


def run(params, cfg, prompts, args) -> tuple[dict, np.ndarray, np.ndarray]:
  """The requests through a fresh engine: (timings, tokens [N, new], log-probs [N, new]), rows in submission order."""
  config = EngineConfig(max_seqs=args.max_seqs, pages=args.max_seqs * -(-(args.prompt_len + args.new_tokens) //
                                                                          args.page_size) + 8,
                        page_size=args.page_size, max_seq_len=args.prompt_len + args.new_tokens,
                        decode_steps=args.decode_steps, prefill_chunk=args.prompt_len, prefill_rows=8)
  engine = RolloutEngine(cfg, config, sampling=SamplingConfig(temperature=1.0), seed=args.seed)
  ids = [i for p in prompts for i in engine.submit(p, max_new_tokens=args.new_tokens, samples=args.samples)]
  start = time.perf_counter()
  done = engine.run(params)
  wall = time.perf_counter() - start
  tokens = np.stack([done[i].tokens for i in ids])
  return {"wall_s": round(wall, 3), "tokens": int(tokens.size)}, tokens, np.stack([done[i].log_probs for i in ids])


def policy_log_probs(params, cfg, prompts, tokens, samples: int, chunk: int = 4) -> np.ndarray:
  """The float policy's log-probs [N, new] of the sampled tokens after their prompts, `chunk` rows per forward."""
  rows = np.asarray([p + list(t) for p, t in zip([p for p in prompts for _ in range(samples)], tokens)], np.int32)
  score = jax.jit(lambda p, x: token_log_probs(forward(p, x, cfg)[:, :-1], x[:, 1:]))
  out = np.concatenate([np.asarray(score(params, jnp.asarray(rows[i:i + chunk]))) for i in range(0, len(rows), chunk)])
  return out[:, -tokens.shape[1]:]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", choices=sorted(CONFIGS), default="smollm2")
  parser.add_argument("--model-dir", help="an HF directory of the config's model (real weights); default random init")
  parser.add_argument("--params", default=",".join(PARAMS), help=f"comma-separated, of {PARAMS}")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--samples", type=int, default=4)
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--max-seqs", type=int, default=32)
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--decode-steps", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  names = args.params.split(",")
  if unknown := set(names) - set(PARAMS):
    raise SystemExit(f"--params: unknown {sorted(unknown)}; known: {PARAMS}")

  if args.model_dir:
    model = load_hf(args.model_dir, dtype="float32")
    cfg, params = model.cfg, model.params
  else:
    cfg = CONFIGS[args.config]()
    params = init_params(cfg, jax.random.key(args.seed))
  rollout = jax.jit(rollout_params, static_argnames="cfg")(params, cfg=cfg)
  trees = {"float": params, "int8": rollout}
  prompts = requests(cfg, args)
  results: dict[str, list[dict]] = {name: [] for name in names}
  sampled: dict[str, np.ndarray] = {}

  def measure(name: str, round_: int) -> None:
    if round_ == 0:  # compile
      run(trees[name], cfg, prompts, args)
    timing, tokens, logps = run(trees[name], cfg, prompts, args)
    record = {"params": name, "round": round_, **timing, "tokens_per_s": round(timing["tokens"] / timing["wall_s"], 1),
              "param_bytes": sum(x.nbytes for x in jax.tree.leaves(trees[name]))}
    if name != "float" and round_ == 0:
      policy = policy_log_probs(params, cfg, prompts, tokens, args.samples)
      gap = logprob_gap(jnp.ones(tokens.shape), jnp.asarray(policy), jnp.asarray(logps))
      record.update({k: round(float(v), 5) for k, v in gap.items()})
      if "float" in sampled:
        differs = tokens != sampled["float"]
        record["same_prefix_tokens"] = float(np.where(differs.any(1), differs.argmax(1), tokens.shape[1]).mean())
    sampled.setdefault(name, tokens)
    results[name].append(record)
    print(json.dumps(record), flush=True)

  for round_ in range(args.rounds):
    for name in names:
      measure(name, round_)
  # The best round besides the median: on a shared machine, other work only ever slows a round down.
  summary = {}
  for stat, pick in (("median", statistics.median), ("best", max)):
    per_tree = {name: pick(r["tokens_per_s"] for r in records) for name, records in results.items()}
    summary[f"tokens_per_s_{stat}"] = per_tree
    if "float" in per_tree:
      summary[f"vs_float_{stat}"] = {name: round(per_tree[name] / per_tree["float"], 3)
                                     for name in names if name != "float"}
  print(json.dumps({"summary": summary, "config": args.model_dir or args.config, "backend": jax.default_backend(),
                    **{k: v for k, v in vars(args).items() if k not in ("config", "model_dir")}}), flush=True)


if __name__ == "__main__":
  main()
