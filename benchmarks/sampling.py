"""Throughput of ptx.sampling.generate, and the quality cost of the int8 KV cache.

The model is the one of the Tunix harness (benchmarks/tunix_harness.py): 2 layers, d_model 256,
4 heads (MHA, head_dim 64), ffn 1024, vocab 512, float32, random init. Prompts
are BOS + 31 random ids in [3, V); the stop id is V, which the model cannot
emit, so every row generates exactly the requested number of tokens. Each
measurement is a blocked call of `generate` (host padding included), timed
after a first call that compiles (`compile_s_wall` is that call minus the
median: about 0 when an earlier measurement compiled the same bucket);
`cpu_s_per_call` is process CPU time, steadier than wall time on a busy
machine. One JSON line per measurement:

  anchor  16 rows = 4 prompts x group 4, prompt 32, 64 new tokens (the Tunix
          sampler bench); with --tunix-python, alternated with
          `tunix_bench.py --parts sample` run by that interpreter (an odd
          --runs), and a closing line with every round's figure, the
          median of the per-round medians on each side and their ratio
          (benchmarks/run_medians.py)
  batch   rows 1..256, prompt 32, 64 new tokens
  length  16 rows, 64..4096 new tokens. A decode step reads its cache,
          which grows in phases with the fill (`ptx.sampling.generation`),
          so a step costs what the filled part does, within 2x; memory-bound
          on CPU (16 rows x 4 heads x 64 dims x 4 bytes x K,V x 2 layers =
          64 KB a slot)
  int8    greedy agreement and log-prob error of the int8 cache against the
          training forward, and its throughput at 1024 new tokens
  groups  groups whose prompts are copied to each row against groups that
          share one copy (`generate(shared_prompts=...)`; by default from
          `ptx.models.shared_prefix.SHARED_PREFIX_MIN_SLOTS` columns): prompts
          of 32..512 tokens, tokens/s and the program's temporary memory
          (where the KV cache lives)

    .venv/bin/python benchmarks/sampling.py --parts anchor --rounds 5 \
        --tunix-python /tmp/tunix-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from ptx.model_config import ModelConfig
from ptx.models import init_params
from ptx.models.decoder import forward, token_log_probs
from ptx.sampling import SamplingConfig, buckets, generate
from ptx.sampling import generation

import run_medians  # benchmarks/ is the script's folder, first on sys.path
import tunix_harness

CFG = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=64, mlp_dim=1024,
                  rope_theta=500_000.0, norm_eps=1e-5)
PROMPT_LEN = 32


def _prompts(n: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
  ids = np.random.default_rng(seed).integers(3, CFG.vocab_size, (n, length - 1))
  return [[1] + row.tolist() for row in ids]


def _time(params, *, prompts: int, group: int, new: int, runs: int, kv_int8: bool = False,
          prompt_len: int = PROMPT_LEN, shared_prompts: bool | None = None) -> dict:
  """Median wall time of blocked generate calls, and the first call's extra (compile) time."""

  def call(seed):
    t0 = time.perf_counter()
    out = generate(params, _prompts(prompts, seed, prompt_len), cfg=CFG, max_new_tokens=new, sampling=SamplingConfig(),
                   rng=jax.random.key(seed), stop_ids=[CFG.vocab_size], group_size=group, kv_int8=kv_int8,
                   shared_prompts=shared_prompts)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out

  first, _ = call(0)
  times, cpu, generated = [], [], 0
  for i in range(runs):
    cpu_start = time.process_time()
    seconds, out = call(100 + i)
    times.append(seconds)
    cpu.append(time.process_time() - cpu_start)
    generated = int(out.lengths.sum())
  median = statistics.median(times)
  return {"rows": prompts * group, "prompts": prompts, "group_size": group, "prompt_len": prompt_len,
          "new_tokens": new, "kv_int8": kv_int8, "gen_tokens_per_s": round(generated / median, 1),
          "call_s_median": round(median, 5), "call_s_min": round(min(times), 5), "runs": runs,
          "cpu_s_per_call": round(statistics.mean(cpu), 4),
          "compile_s_wall": round(first - median, 3), "loadavg_1m": round(_loadavg(), 2)}


def _int8_quality(params, *, new: int) -> dict:
  """Int8 vs float cache: greedy agreement, and sampler log-probs vs the training forward."""
  prompts = _prompts(16, 7)
  runs = {}
  for int8 in (False, True):
    for greedy in (True, False):
      runs[int8, greedy] = generate(params, prompts, cfg=CFG, max_new_tokens=new,
                                    sampling=SamplingConfig(greedy=greedy), rng=jax.random.key(3),
                                    stop_ids=[CFG.vocab_size], kv_int8=int8)
  agree = np.asarray(runs[True, True].tokens) == np.asarray(runs[False, True].tokens)
  first_diff = np.where(agree.all(axis=1), new, np.argmin(agree, axis=1))
  sampled = runs[True, False]
  sequences = jnp.concatenate([jnp.asarray(prompts, jnp.int32), sampled.tokens], axis=1)
  logits = jax.jit(forward, static_argnames="cfg")(params, sequences, CFG)[:, PROMPT_LEN - 1:-1]
  error = np.abs(np.asarray(token_log_probs(logits, sampled.tokens)) - np.asarray(sampled.log_probs))
  float_error = np.abs(np.asarray(token_log_probs(
      jax.jit(forward, static_argnames="cfg")(params, jnp.concatenate(
          [jnp.asarray(prompts, jnp.int32), runs[False, False].tokens], axis=1), CFG)[:, PROMPT_LEN - 1:-1],
      runs[False, False].tokens)) - np.asarray(runs[False, False].log_probs))
  return {"int8_quality": True, "rows": 16, "new_tokens": new,
          "greedy_token_agreement": round(float(agree.mean()), 4),
          "greedy_first_divergence_median": float(np.median(first_diff)),
          "logprob_abs_err_mean": float(error.mean()), "logprob_abs_err_max": float(error.max()),
          "float_cache_logprob_abs_err_max": float(float_error.max()),
          "mean_token_entropy_nats": float(-np.asarray(sampled.log_probs).mean())}


def _groups(params, runs: int) -> list[dict]:
  """Copied against shared prompt K/V for groups, by prompt length: tokens/s and the program's temp memory."""
  records = []
  for prompt_len, prompts, group in ((32, 4, 4), (128, 4, 4), (512, 2, 8)):
    for shared in (False, True):
      padded, lengths = buckets.left_pad(_prompts(prompts, 0, prompt_len), prompts, buckets.bucket(prompt_len, 8), 0)
      program = generation._generate_jit.lower(
          params, padded, lengths, buckets.stop_table([CFG.vocab_size], prompts, prompts), jax.random.key(0),
          np.int32(64), cfg=CFG, sampling=SamplingConfig(), budget=64, group_size=group,
          shared_prompts=shared).compile()
      records.append({"part": "groups", "shared_prompts": shared,
                      "temp_mib": round(program.memory_analysis().temp_size_in_bytes / 2**20, 2),
                      **_time(params, prompts=prompts, group=group, new=64, runs=runs, prompt_len=prompt_len,
                              shared_prompts=shared)})
  return records


def _anchor(params, args) -> None:
  """The Tunix-comparable config, alternated with Tunix's own bench when its interpreter is given."""
  lines = []
  for _ in range(args.rounds):
    if args.tunix_python:
      bench = tunix_harness.path()
      line = subprocess.run([args.tunix_python, str(bench), "--parts", "sample", "--steps", str(args.runs)],
                            capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
      lines.append({"framework": "tunix", "part": "anchor", **json.loads(line)["sample"]})
      print(json.dumps(lines[-1]), flush=True)
    lines.append({"framework": "ptx", "part": "anchor", **_time(params, prompts=4, group=4, new=64, runs=args.runs)})
    print(json.dumps(lines[-1]), flush=True)
  if args.tunix_python:
    print(json.dumps(run_medians.summary(run_medians.SAMPLING, lines)), flush=True)


def _loadavg() -> float:
  with open("/proc/loadavg") as f:
    return float(f.read().split()[0])


def main() -> None:
  """Runs the selected parts and prints one JSON line per measurement."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--parts", default="anchor,batch,length,int8,groups")
  p.add_argument("--runs", type=int, default=5, help="timed calls per measurement (median)")
  p.add_argument("--rounds", type=int, default=1, help="anchor measurements (alternating with Tunix)")
  p.add_argument("--tunix-python", default="", help="interpreter of a venv with google-tunix installed")
  p.add_argument("--batches", default="1,4,16,64,256")
  p.add_argument("--lengths", default="64,256,1024,2048,4096")
  args = p.parse_args()
  parts = args.parts.split(",")
  if args.tunix_python and "anchor" in parts:
    run_medians.check_odd(args.runs, "--runs")
  params = init_params(CFG, jax.random.key(0))
  emit = lambda record: print(json.dumps({"framework": "ptx", **record}), flush=True)  # noqa: E731
  if "anchor" in parts:
    _anchor(params, args)
  if "batch" in parts:
    for rows in map(int, args.batches.split(",")):
      emit({"part": "batch", **_time(params, prompts=rows, group=1, new=64, runs=args.runs)})
  if "length" in parts:
    for new in map(int, args.lengths.split(",")):
      runs = max(1, args.runs * 256 // max(new, 256))  # long generations: fewer runs
      emit({"part": "length", **_time(params, prompts=4, group=4, new=new, runs=runs)})
  if "int8" in parts:
    emit({"part": "int8", **_int8_quality(params, new=256)})
    emit({"part": "int8", **_time(params, prompts=4, group=4, new=1024, runs=1, kv_int8=True)})
  if "groups" in parts:
    for record in _groups(params, args.runs):
      emit(record)


if __name__ == "__main__":
  main()
