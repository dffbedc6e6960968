"""Rollout throughput on long-tailed work: the engine (continuous batching over pages) against static batches.

Methods, each on the same requests (prompts: BOS + 31 random ids):

  static  `ptx.sampling.generate` over consecutive batches of --static-rows
          requests in submission order, each batch run to its largest budget
          (a row cannot stop at its own budget, only at a stop id)
  engine  `ptx.sampling.engine.engine.RolloutEngine`: every request submitted with
          its own budget, run to the end; --max-seqs rows, a pool of pages no
          larger than the static batches' KV cache (`kv_bytes`)
  engine_int8  the engine with int8 pages (`EngineConfig.kv_dtype`) in the same
          KV bytes: more pages (int8 values and a float32 scale per slot and
          head, against the compute dtype), the same --max-seqs rows
  engine_on_demand  the engine with `EngineConfig.admission="on_demand"` in
          the same pool: a request takes pages as it grows rather than its
          whole budget at admission, and the last submitted are preempted
          (and recomputed) when the pool runs out; `preemptions` counts them
  engine_pallas  the engine with `attention_impl="pallas"`: the platform's
          Pallas paged kernel reads the pages in place (GPU or TPU only)
  tunix   (with --tunix-python) Tunix's Sampler, timed by its harness
          (`tunix_bench.py --parts sample`) on one batch of --static-rows rows
          at the workload's cap: its sampler takes one generation length per
          call, and its RL rollouts one per run (`max_tokens_to_generate`), so
          the workload costs ceil(requests / rows) such calls

Workloads:

  uniform   4 prompts x 4 samples, 64 new tokens each (the sampling anchor):
            every row the same length, where static batches waste nothing
  longtail  --requests budgets ~ log-normal (median --median, 99th percentile
            --p99, clipped to [1, --p99 ... the cap]); no stop id
  stops     --requests at the cap, ended by a stop id that a model trained here
            (--train-steps SFT steps on random text where the stop id follows
            each token with probability 1 / --median) samples itself; with
            --stop-model FILE the model is read from FILE when it exists (made
            by the same --config, --train-steps, --median and --seed), else
            trained and written there, so a shape whose training takes most
            of an hour trains once

`useful_tokens` counts each request's tokens up to its own budget or stop;
`useful_tokens_per_s` divides them by the timed run's wall seconds. Every
program a timed run calls has compiled before it: each method runs its
workload twice, the first run compiling (`compile_s_wall` is the
difference), except static with `--static-warmup compile`, which first
generates one token per batch in that batch's program (`generate(budget=...)`)
and so halves a long workload's untimed time. The timed run then also pays
first-run costs (on the uniform anchor, static's first full run is ~30%
slower than its second); on a workload of minutes they are a rounding error.
--rounds alternate the methods. With --reseed, round r samples with seed
--seed + r * 1000 (prompts, budgets and the stop model stay --seed's): on a
workload ended by sampled stops each round then draws other lengths, so the
rounds measure the draw as well as the machine (without it every round
repeats one draw). Static batches and the engine use a seed's key in
different ways, so one seed does not give the two methods the same lengths.
`kv_bytes` is the KV memory a method holds at its peak: the static cache of
its largest batch, or the engine's pool. One JSON line per run, then one
summary per workload: each method's median over rounds, the ratios of those
medians, and each round's ratios (`..._per_round`).

    .venv/bin/python benchmarks/rollout.py --config tiny --workloads uniform,longtail,stops \
        --tunix-python /tmp/tunix-venv/bin/python
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import subprocess
import time

import jax
import numpy as np

from ptx.algorithms import sft
from ptx.config import MeshConfig, OptimizerConfig
from ptx.models import init_params
from ptx.models.llama import smollm2_135m
from ptx.sampling import SamplingConfig, buckets, generate
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig
from ptx.sharding import make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.state import init_state, state_shardings
from ptx.train.step import make_train_step

import sampling as sampling_bench  # benchmarks/ is the script's folder, first on sys.path
import tunix_harness

CONFIGS = {"tiny": sampling_bench.CFG, "smollm2": smollm2_135m()}
PROMPT_LEN = 32
STOP_ID = 2  # trained into the `stops` model; never a prompt id (prompts draw from [3, V))
RESEED_STRIDE = 1000  # static's batch b of a round samples with key seed + b: rounds' seeds must not meet
# What --methods names; Tunix runs with --tunix-python.
METHODS = ("static", "engine", "engine_int8", "engine_on_demand", "engine_pallas")


@dataclasses.dataclass(frozen=True)
class Workload:
  """Requests: prompts, samples per prompt, budgets and the stop id (None: none)."""

  name: str
  prompts: list[list[int]]
  samples: int
  budgets: list[int]  # per prompt
  stop_id: int | None


def longtail_budgets(n: int, median: int, p99: int, seed: int) -> list[int]:
  """n budgets ~ log-normal with the given median and 99th percentile, clipped to [1, p99]."""
  sigma = math.log(p99 / median) / 2.3263478740  # the standard normal's 99th percentile
  draws = np.random.default_rng(seed).lognormal(math.log(median), sigma, n)
  return np.clip(np.round(draws), 1, p99).astype(int).tolist()


def random_prompts(n: int, *, vocab_size: int, rng: np.random.Generator) -> list[list[int]]:
  """n prompts of PROMPT_LEN tokens: BOS, then ids drawn from [3, vocab_size) (never STOP_ID)."""
  return [[1] + rng.integers(3, vocab_size, PROMPT_LEN - 1).tolist() for _ in range(n)]


def workload(name: str, cfg, args) -> Workload:
  """The requests of workload `name` for model `cfg`."""
  rng = np.random.default_rng(args.seed)
  prompts = functools.partial(random_prompts, vocab_size=cfg.vocab_size, rng=rng)
  if name == "uniform":
    return Workload(name, prompts(4), 4, [64] * 4, None)
  if name == "longtail":
    return Workload(name, prompts(args.requests), 1, longtail_budgets(args.requests, args.median, args.p99,
                                                                      args.seed), None)
  if name == "stops":
    return Workload(name, prompts(args.requests), 1, [args.p99] * args.requests, STOP_ID)
  raise SystemExit(f"--workloads: unknown workload {name!r}; known: uniform, longtail, stops")


def train_stop_model(cfg, args) -> dict:
  """`cfg` trained for --train-steps SFT steps on random ids where STOP_ID follows each with probability 1/median."""
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=1), jax.devices()[:1])
  optimizer = make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=0, weight_decay=0.0, clip_norm=1.0),
                             args.train_steps)
  state = init_state(cfg, optimizer, args.seed, mesh)
  step = make_train_step(functools.partial(sft.loss, model=cfg), optimizer, mesh=mesh,
                         state_shardings=state_shardings(cfg, optimizer, mesh))
  rng = np.random.default_rng(args.seed)
  shape = (8, 256)
  for _ in range(args.train_steps):
    tokens = np.where(rng.random(shape) < 1 / args.median, STOP_ID, rng.integers(3, cfg.vocab_size, shape))
    batch = {"tokens": tokens.astype(np.int32), "loss_mask": np.ones(shape, np.int32),
             "segment_ids": np.ones(shape, np.int32),
             "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy()}
    state, _ = step(state, batch)
  return jax.device_get(state.params)


def stop_model(cfg, args) -> dict:
  """The `stops` model: read from --stop-model when that file exists, else trained (and written there if given)."""
  recipe = {"config": args.config, "train_steps": args.train_steps, "median": args.median, "seed": args.seed}
  path = args.stop_model
  if path and os.path.exists(path):
    return read_params(path, cfg, recipe)
  params = train_stop_model(cfg, args)
  if path:
    leaves = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    with open(path + ".tmp", "wb") as f:
      np.savez(f, __recipe__=np.asarray(json.dumps(recipe, sort_keys=True)), **leaves)
    os.replace(path + ".tmp", path)  # a run killed while writing leaves no file to be read as a model
  return params


def read_params(path: str, cfg, recipe: dict) -> dict:
  """The parameters written by `stop_model` at `path`, checked against `recipe` and `cfg`'s shapes."""
  with np.load(path) as saved:
    made = json.loads(str(saved["__recipe__"]))
    for name, value in recipe.items():
      if made.get(name) != value:
        raise SystemExit(f"--stop-model {path}: made with {name}={made.get(name)!r}, this run asks for {value!r}")
    expected, tree = jax.tree_util.tree_flatten_with_path(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))
    leaves = []
    for key, shape in expected:
      name = jax.tree_util.keystr(key)
      if name not in saved or saved[name].shape != shape.shape:
        raise SystemExit(f"--stop-model {path}: {name} is missing or not of shape {shape.shape}")
      leaves.append(saved[name])
  return jax.tree_util.tree_unflatten(tree, leaves)


def static_kv_bytes(cfg, rows: int, prompt_len: int, budget: int) -> int:
  """`generate`'s KV cache at its largest: rows x (prompt + budget - 1) slots of K and V in every layer."""
  slots = buckets.bucket(prompt_len, 8) + buckets.bucket(budget, 8) - 1
  return 2 * cfg.n_layers * buckets.bucket(rows) * cfg.n_kv_heads * slots * cfg.head_dim * np.dtype(
      cfg.compute_dtype).itemsize


def useful(tokens: np.ndarray, budget: int, stop_id: int | None) -> int:
  """A request's tokens up to its budget and its first stop id, the stop included."""
  tokens = np.asarray(tokens)[:budget]
  if stop_id is not None and (tokens == stop_id).any():
    return int(np.argmax(tokens == stop_id)) + 1
  return int(tokens.size)


def static_batches(work: Workload, rows: int) -> list[tuple[list, list[int]]]:
  """The static method's batches: consecutive (prompts, budgets) of `rows` rows (prompts x samples)."""
  per_batch = max(1, rows // work.samples)
  return [(work.prompts[s:s + per_batch], work.budgets[s:s + per_batch])
          for s in range(0, len(work.prompts), per_batch)]


def run_static(params, cfg, work: Workload, rows: int, sampling: SamplingConfig, seed: int,
               warm_only: bool = False) -> dict:
  """The workload in consecutive static batches, each to its largest budget.

  With `warm_only`, each batch instead generates one token in the program of
  its budget, so every program the workload needs compiles without its decoding.
  """
  total, generated, peak = 0, 0, 0
  stop_ids = [] if work.stop_id is None else [work.stop_id]
  for start, (prompts, budgets) in enumerate(static_batches(work, rows)):
    out = generate(params, prompts, cfg=cfg, max_new_tokens=1 if warm_only else max(budgets), sampling=sampling,
                   rng=jax.random.key(seed + start), stop_ids=stop_ids, group_size=work.samples,
                   budget=max(budgets))
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for row in range(tokens.shape[0]):
      total += useful(tokens[row, :lengths[row]], budgets[row // work.samples], work.stop_id)
    generated += int(lengths.sum())
    peak = max(peak, static_kv_bytes(cfg, len(prompts) * work.samples, PROMPT_LEN, max(budgets)))
  return {"useful_tokens": total, "generated_tokens": generated, "kv_bytes": peak}


def engine_config(cfg, work: Workload, args, kv_dtype: str = "auto", admission: str = "reserve") -> EngineConfig:
  """The engine's shapes: a pool no larger than the static batches' largest KV cache, in `kv_dtype` pages."""
  cap = max(work.budgets)
  slot_bytes = cfg.head_dim + 4 if kv_dtype == "int8" else cfg.head_dim * np.dtype(cfg.compute_dtype).itemsize
  pool_bytes = static_kv_bytes(cfg, args.static_rows, PROMPT_LEN, cap)
  pool_slots = pool_bytes // (2 * cfg.n_layers * cfg.n_kv_heads * slot_bytes)
  return EngineConfig(max_seqs=args.max_seqs, pages=pool_slots // args.page_size, page_size=args.page_size,
                      max_seq_len=PROMPT_LEN + cap, decode_steps=args.decode_steps, prefill_chunk=PROMPT_LEN,
                      prefill_rows=args.prefill_rows, kv_dtype=kv_dtype, admission=admission)


def run_engine(params, cfg, work: Workload, config: EngineConfig, sampling: SamplingConfig, seed: int) -> dict:
  """The workload through one engine: every request submitted at once with its own budget."""
  engine = RolloutEngine(cfg, config, sampling=sampling, seed=seed)
  stop_ids = [] if work.stop_id is None else [work.stop_id]
  ids = [(engine.submit(p, max_new_tokens=b, stop_ids=stop_ids, samples=work.samples), b)
         for p, b in zip(work.prompts, work.budgets)]
  done = engine.run(params)
  total = sum(useful(done[i].tokens, budget, work.stop_id) for seq_ids, budget in ids for i in seq_ids)
  lengths = [len(done[i].tokens) for seq_ids, _ in ids for i in seq_ids]
  return {"useful_tokens": total, "generated_tokens": sum(lengths), "kv_bytes": engine.pool_bytes,
          "peak_pages_in_use": engine.allocator.peak_in_use, "pages": config.pages, "preemptions": engine.preemptions,
          "length_median": float(np.median(lengths)), "length_p99": float(np.percentile(lengths, 99))}


def timed(fn, warm=None) -> dict:
  """Times `fn` after a run of `warm` (default: `fn` itself) that compiles its programs.

  Returns `fn`'s figures with wall and process CPU seconds; `compile_s_wall`
  is the warm run's wall seconds less the timed run's when `warm` is `fn`, and
  the warm run's whole wall time otherwise.
  """
  start = time.perf_counter()
  (warm or fn)()
  first = time.perf_counter() - start
  start, cpu = time.perf_counter(), time.process_time()
  record = fn()
  wall = time.perf_counter() - start
  return {**record, "wall_s": round(wall, 3), "cpu_s": round(time.process_time() - cpu, 3),
          "useful_tokens_per_s": round(record["useful_tokens"] / wall, 1),
          "compile_s_wall": round(first - (0 if warm else wall), 2)}


def tunix_model_dims(cfg) -> str:
  """`cfg` as the Tunix harness's --model-dims (layers,d_model,heads,kv_heads,ffn,vocab; head_dim = d_model/heads)."""
  if cfg.d_model != cfg.n_heads * cfg.head_dim:
    raise SystemExit(f"--tunix-python: the Tunix harness derives head_dim from d_model; this config's "
                     f"head_dim {cfg.head_dim} is not d_model {cfg.d_model} / n_heads {cfg.n_heads}")
  return f"{cfg.n_layers},{cfg.d_model},{cfg.n_heads},{cfg.n_kv_heads},{cfg.mlp_dim},{cfg.vocab_size}"


def run_tunix(cfg, work: Workload, args) -> dict:
  """Tunix's Sampler on one batch of --static-rows at the cap, scaled to the workload's number of batches."""
  cap = max(work.budgets)
  rows = args.static_rows
  line = subprocess.run([args.tunix_python, str(tunix_harness.path()), "--parts", "sample", "--sample-batch",
                         str(rows), "--prompt-len", str(PROMPT_LEN), "--gen-len", str(cap), "--warmup", "1",
                         "--steps", str(args.tunix_calls), "--model-dims", tunix_model_dims(cfg)],
                        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
  sample = json.loads(line)["sample"]
  calls = math.ceil(len(work.prompts) * work.samples / rows)
  useful_tokens = sum(min(b, cap) for b in work.budgets) * work.samples
  wall = calls * sample["call_s_median"]
  return {"useful_tokens": useful_tokens, "generated_tokens": calls * rows * cap, "calls": calls,
          "call_s_median": sample["call_s_median"], "cpu_s": round(calls * sample["cpu_s_per_call"], 3),
          "wall_s": round(wall, 3), "useful_tokens_per_s": round(useful_tokens / wall, 1),
          "timed_calls": args.tunix_calls, "kv_bytes": static_kv_bytes(cfg, rows, PROMPT_LEN, cap)}


def parser() -> argparse.ArgumentParser:
  """The command line (`benchmarks/device_check.py` builds its `rollout` section's arguments with it)."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
  p.add_argument("--workloads", default="uniform,longtail,stops")
  p.add_argument("--methods", default="static,engine")
  p.add_argument("--requests", type=int, default=256)
  p.add_argument("--median", type=int, default=128)
  p.add_argument("--p99", type=int, default=2048)
  p.add_argument("--static-rows", type=int, default=16)
  p.add_argument("--max-seqs", type=int, default=64)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--decode-steps", type=int, default=16)
  p.add_argument("--prefill-rows", type=int, default=16)
  p.add_argument("--train-steps", type=int, default=150)
  p.add_argument("--stop-model", default="", help="npz file of the stops model: read if it exists, else written")
  p.add_argument("--rounds", type=int, default=1)
  p.add_argument("--static-warmup", default="full", choices=("full", "compile"),
                 help="static's untimed first run: the whole workload, or one token per batch in its program "
                      "(for long workloads; the timed run then also pays first-run costs such as page faults)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--reseed", action="store_true", help="round r samples with seed --seed + r * 1000 (see above)")
  p.add_argument("--tunix-calls", type=int, default=3, help="Tunix's timed sampler calls (after one warm-up)")
  p.add_argument("--tunix-python", default="", help="interpreter of a venv with google-tunix (adds the tunix method)")
  return p


def rows(args):
  """Yields one record per run, every method on every workload alternating over rounds, then a summary per workload."""
  cfg = CONFIGS[args.config]
  methods = args.methods.split(",")
  unknown = sorted(set(methods) - set(METHODS))
  if unknown or "tunix" in methods:
    raise SystemExit(f"--methods: unknown {', '.join(unknown or ['tunix'])}; known: {', '.join(METHODS)} (Tunix "
                     "runs with --tunix-python)")
  methods += ["tunix"] if args.tunix_python else []
  sampling = SamplingConfig()
  base = {"framework": "ptx", "config": args.config, "backend": jax.default_backend()}
  for name in args.workloads.split(","):
    work = workload(name, cfg, args)
    params = stop_model(cfg, args) if name == "stops" else init_params(cfg, jax.random.key(args.seed))
    config, int8_config = engine_config(cfg, work, args), engine_config(cfg, work, args, "int8")
    on_demand_config = engine_config(cfg, work, args, admission="on_demand")
    runs = {method: [] for method in methods}
    for round_ in range(args.rounds):
      seed = args.seed + RESEED_STRIDE * round_ if args.reseed else args.seed
      for method in methods:
        if method == "static":
          static = functools.partial(run_static, params, cfg, work, args.static_rows, sampling, seed)
          record = timed(static, warm=functools.partial(static, warm_only=True) if args.static_warmup == "compile"
                         else None)
        elif method == "engine":
          record = timed(lambda: run_engine(params, cfg, work, config, sampling, seed))
        elif method == "engine_int8":
          record = timed(lambda: run_engine(params, cfg, work, int8_config, sampling, seed))
        elif method == "engine_on_demand":
          record = timed(lambda: run_engine(params, cfg, work, on_demand_config, sampling, seed))
        elif method == "engine_pallas":
          record = timed(lambda: run_engine(params, dataclasses.replace(cfg, attention_impl="pallas"), work, config,
                                            sampling, seed))
        elif method == "tunix" and name != "stops":  # the trained model's weights live in ptx only
          record = run_tunix(cfg, work, args)
        else:
          continue
        seeded = {} if method == "tunix" else {"sampling_seed": seed}  # Tunix's harness draws with its own
        record = {**base, "workload": name, "method": method, "round": round_, **seeded,
                  "requests": len(work.prompts) * work.samples, "loadavg_1m": round(os.getloadavg()[0], 2), **record}
        runs[method].append(record)
        yield record
    medians = {m: statistics.median(r["useful_tokens_per_s"] for r in rs) for m, rs in runs.items() if rs}
    summary = {**base, "workload": name, "summary": True, "useful_tokens_per_s_median": medians,
               "kv_bytes": {m: rs[0]["kv_bytes"] for m, rs in runs.items() if rs},
               "per_run": {m: [r["useful_tokens_per_s"] for r in rs] for m, rs in runs.items() if rs}}
    pairs = [("engine", other) for other in ("static", "tunix")]
    pairs += [(variant, "engine") for variant in ("engine_int8", "engine_on_demand", "engine_pallas")]
    pairs += [(variant, "static") for variant in ("engine_on_demand", "engine_pallas")]
    for method, other in pairs:
      if method in medians and other in medians:
        summary[f"{method}_over_{other}"] = round(medians[method] / medians[other], 2)
        summary[f"{method}_over_{other}_per_round"] = [
            round(a["useful_tokens_per_s"] / b["useful_tokens_per_s"], 2) for a, b in zip(runs[method], runs[other])]
    yield summary


def main() -> None:
  """Runs every method on every workload, alternating over rounds; one JSON line per run, then summaries."""
  for row in rows(parser().parse_args()):
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
