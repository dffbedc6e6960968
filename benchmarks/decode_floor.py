"""How far the anchor sampler is from the cost of its weight products alone (its matmul floor).

A decode step of the anchor model (`benchmarks/sampling.py`: 2 layers, d_model
256, MLP 1024, vocab 512, float32, 16 rows) multiplies 16 activation rows by
every weight matrix once: 8.5 MB of float32 weights per step, more than the
2 MB L2 of a core here, so the products stream them from L3. `floor` runs
exactly those products (q, k, v, o, gate, up, down per layer, then the
output head), chained so that no step can start early, 64 times in one
`lax.fori_loop`: no attention, cache, sampling or stop logic. `sampler` is
the compiled anchor program of `generate_padded` (4 prompts x group 4,
prompt 32, 64 new tokens). Both are compiled once and called alternately in
one process, so the machine's drift touches both alike; the closing line
gives the median of the per-pair ratios floor / sampler.

Besides its weights, a decode step reads its whole KV cache (64 KB a slot
here: 16 rows x 4 heads x 64 dims x 4 bytes x K and V x 2 layers), whose
size grows in phases with the fill (`ptx.sampling.generation`). The closing
line also adds those bytes up over a call and divides weights + cache by the
floor's bandwidth: the time a call would take if it did nothing but read
them at the rate the products do.

    .venv/bin/python benchmarks/decode_floor.py --pairs 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ptx.models import init_params
from ptx.models.decoder import unstack_layers
from ptx.sampling import SamplingConfig, generation
from sampling import CFG, PROMPT_LEN, _prompts

PROMPTS, GROUP, NEW = 4, 4, 64


def weight_products(params, x_BTD: jax.Array, steps: int) -> jax.Array:
  """`steps` decode steps' weight products on rows x [B, 1, D], each step fed by the previous one."""
  layers = unstack_layers(params, CFG)["layers"]

  def step(_, x_BTD):
    for p in layers:
      q, k, v = (jnp.einsum("btd,dhk->bthk", x_BTD, p[name]) for name in ("q", "k", "v"))
      x_BTD = x_BTD + jnp.einsum("bthk,hkd->btd", q * k + v, p["o"])
      gate, up = jnp.einsum("btd,df->btf", x_BTD, p["gate"]), jnp.einsum("btd,df->btf", x_BTD, p["up"])
      x_BTD = x_BTD + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, p["down"])
    logits_BTV = jnp.einsum("btd,dv->btv", x_BTD, params["lm_head"])
    return x_BTD + 1e-3 * logits_BTV[..., :CFG.d_model]

  return jax.lax.fori_loop(0, steps, step, x_BTD)


def main() -> None:
  """Times the sampler and its floor alternately and prints one JSON line each, then their ratio."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--pairs", type=int, default=40, help="alternated (sampler, floor) calls timed")
  args = p.parse_args()
  params = init_params(CFG, jax.random.key(0))
  rows = PROMPTS * GROUP

  def sampler_args(seed: int):
    prompts = jnp.asarray(np.array(_prompts(PROMPTS, seed)), jnp.int32)
    return (params, prompts, jnp.full((PROMPTS,), PROMPT_LEN, jnp.int32),
            jnp.full((PROMPTS, 1), CFG.vocab_size, jnp.int32), jax.random.key(seed), NEW)

  # The program `generate` runs for the anchor (same jit, static arguments and shapes), without its host padding.
  sampler = generation._generate_jit.lower(*sampler_args(0), cfg=CFG, sampling=SamplingConfig(), budget=NEW,
                                           group_size=GROUP).compile()
  x = jax.random.normal(jax.random.key(1), (rows, 1, CFG.d_model), jnp.float32)
  floor = jax.jit(weight_products, static_argnums=2).lower(params, x, NEW).compile()
  calls = {"sampler": lambda seed: sampler(*sampler_args(seed)), "floor": lambda seed: floor(params, x)}
  times = {name: [] for name in calls}
  for i in range(args.pairs + 1):
    for name, call in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(call(100 + i))
      if i:  # the first pair warms both up
        times[name].append(time.perf_counter() - start)
  weights_mb = sum(w.size for w in jax.tree.leaves(params) if w.ndim > 1 and w is not params["embed"]) * 4 / 2**20
  for name, t in times.items():
    print(json.dumps({"part": name, "rows": rows, "steps": NEW, "call_s_median": round(statistics.median(t), 5),
                      "call_s_min": round(min(t), 5), "step_ms_median": round(statistics.median(t) / NEW * 1e3, 3),
                      "pairs": args.pairs}), flush=True)
  ratios = [f / s for f, s in zip(times["floor"], times["sampler"])]
  mb_per_s = weights_mb * NEW / statistics.median(times["floor"])
  cache_mb = _cache_mb_per_call(rows)
  print(json.dumps({"part": "summary", "floor_over_sampler_median": round(statistics.median(ratios), 3),
                    "weights_mb_per_step": round(weights_mb, 2), "floor_gb_per_s": round(mb_per_s / 1024, 2),
                    "cache_mb_per_call": round(cache_mb, 1),
                    "bytes_bound_call_s": round((weights_mb * (NEW - 1) + cache_mb) / mb_per_s, 5),
                    "sampler_call_s_median": round(statistics.median(times["sampler"]), 5),
                    "loadavg_1m": os.getloadavg()[0]}), flush=True)


def _cache_mb_per_call(rows: int) -> float:
  """MB of K/V the anchor call's decode steps read: steps 1..NEW-1 each read their phase's whole cache."""
  slot_mb = rows * CFG.n_kv_heads * CFG.head_dim * 4 * 2 * CFG.n_layers / 2**20
  phases = generation._phase_slots(PROMPT_LEN, NEW, 1)  # prompts of 32 columns are copied to each row
  return sum(next(s for s in phases if t <= s - PROMPT_LEN) for t in range(1, NEW)) * slot_mb


if __name__ == "__main__":
  main()
