"""The rollout engine's decode tokens/s against the HBM-bandwidth roofline, one JSON line per row count.

A decode step reads every weight once and each row's cached keys and values
once, so no step takes less than those bytes over the device's HBM bandwidth
(`HBM_BYTES_PER_S`): the roofline. `measure` submits `rows` requests, each a
random prompt of `prompt_len` tokens and `new` greedy tokens (no stop id, so
every row decodes all of them), to a fresh `RolloutEngine` with one slot per
request, twice, the first run compiling (`fast_mode.run`). Each decode call
of the second run is blocked and timed (`timed_decode`): the decode tokens/s
and seconds a step come from those calls alone, while the run's own tokens/s
also holds the prefill and the host's work between calls.

Bytes a step must read, averaged over the run: the parameters as stored
(a tied embedding once, as the output head; an untied input table is read
only at the fed rows, so it is left out) plus, per row, the cache of its
context, which grows from `prompt_len` to `prompt_len + new - 1` positions
(its bytes per position taken from the engine's pool). Dense models only:
a Mixture of Experts reads only the experts its rows are routed to.

The engine compiles a decode program per power-of-two count of the pages
a call reads. With 16-token pages and 16 steps a call, the defaults (a
288-token prompt, 128 new tokens) read 19 to 26 pages a row in every call,
one bucket, so each (rows, model) compiles one decode and one prefill
program (`programs_compiled` says how many it took).

    .venv/bin/python benchmarks/decode_roofline.py --config tiny --rows 4 16

`benchmarks/device_check.py --section decode` runs `measure` at 16, 64 and
256 rows with both `ModelConfig.decode_loop` values.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time

import jax
import numpy as np

from ptx.model_config import ModelConfig
from ptx.models import init_params
from ptx.sampling.engine import programs
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.engine import RolloutEngine

import fast_mode  # benchmarks/ is the script's folder, first on sys.path

# HBM bandwidth by `jax.Device.device_kind`, from NVIDIA's datasheets: the H100 Tensor Core GPU datasheet (SXM5,
# 80 GB HBM3: 3.35 TB/s) and the H200 Tensor Core GPU datasheet (141 GB HBM3e: 4.8 TB/s). A device not listed gets
# no roofline (its rows carry the bytes, so one can be worked out).
HBM_BYTES_PER_S = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H200": 4.8e12}


@contextlib.contextmanager
def timed_decode(of: programs.Programs = programs.SHARED):
  """Inside the block, every decode call of the engines running `of` is blocked and timed.

  Yields the list it appends (seconds, tokens emitted, steps run) to, one entry per call; a call runs as many steps
  as its longest row emitted.
  """
  calls = []
  decode = of.decode

  def timed(*args, **kwargs):
    start = time.perf_counter()
    k, v, out = jax.block_until_ready(decode(*args, **kwargs))
    emitted = np.asarray(out.emitted)
    calls.append((time.perf_counter() - start, int(emitted.sum()), int(emitted.max())))
    return k, v, out

  of.decode = timed
  try:
    yield calls
  finally:
    of.decode = decode


def weight_bytes(cfg: ModelConfig, params) -> int:
  """Bytes of the parameters a decode step reads: all of them but an untied input embedding (gathered by row)."""
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  return total if cfg.tie_embeddings else total - params["embed"].nbytes


def measure(cfg: ModelConfig, params, rows: int, prompt_len: int, new: int, decode_steps: int = 16,
            hbm_bytes_per_s: float | None = None, seed: int = 0) -> dict:
  """Decode tokens/s of `rows` requests through the engine, and the roofline's (module docstring).

  Args:
    cfg: the model, with its dtypes and `decode_loop`.
    params: its parameters.
    rows: requests, all decoding at once (the engine's slots).
    prompt_len: tokens per prompt (random ids past the special ones).
    new: tokens each request generates.
    decode_steps: `EngineConfig.decode_steps`: steps per decode call.
    hbm_bytes_per_s: the device's bandwidth; None leaves the roofline out.
    seed: the prompts' seed.

  Returns:
    The JSON record: the decode calls' tokens/s and seconds a step, the run's tokens/s (prefill and host work
    included), the bytes a step reads, and with a bandwidth the roofline's tokens/s and the fraction reached.
  """
  rng = np.random.default_rng(seed)
  prompts = [[1] + rng.integers(3, cfg.vocab_size, prompt_len - 1).tolist() for _ in range(rows)]
  config = EngineConfig.sized(rows, prompt_len + new, decode_steps=decode_steps, prefill_chunk=prompt_len,
                              prefill_rows=min(rows, 16))
  engines = []
  with timed_decode() as calls:

    def engine_of():  # fast_mode.run builds one engine per run: the calls kept are the last run's
      calls.clear()
      engines.append(RolloutEngine(cfg, config, sampling=fast_mode.GREEDY))
      return engines[-1]

    compiled = programs.SHARED.compiled
    record = fast_mode.run(engine_of, params, prompts, new)
  record.pop("outputs")
  seconds, tokens, steps = (sum(column) for column in zip(*calls))
  kv_bytes_per_position = engines[-1].pool_bytes // (config.pages * config.page_size)
  step_bytes = weight_bytes(cfg, params) + kv_bytes_per_position * rows * (prompt_len + (new - 1) / 2)
  out = dict(bench="decode_roofline", decode_loop=cfg.decode_loop, param_dtype=cfg.param_dtype,
             compute_dtype=cfg.compute_dtype, rows=rows, prompt_len=prompt_len, new=new, decode_steps=decode_steps,
             decode_calls=len(calls), decode_tokens=tokens, decode_s=round(seconds, 4),
             decode_tokens_per_s=round(tokens / seconds, 1), step_s=round(seconds / steps, 6),
             run_tokens_per_s=record["tokens_per_s"], run_wall_s=record["wall_s"], compile_s=record["compile_s"],
             programs_compiled=programs.SHARED.compiled - compiled - record["compiled_in_timed_run"],
             compiled_in_timed_run=record["compiled_in_timed_run"], weight_bytes=weight_bytes(cfg, params),
             kv_bytes_per_position=kv_bytes_per_position, step_bytes=round(step_bytes),
             hbm_bytes_per_s=hbm_bytes_per_s)
  if hbm_bytes_per_s:
    roofline_step_s = step_bytes / hbm_bytes_per_s
    out.update(roofline_step_s=round(roofline_step_s, 7), roofline_tokens_per_s=round(rows / roofline_step_s, 1),
               roofline_fraction=round(roofline_step_s / out["step_s"], 4))
  return out


def main() -> None:
  """Prints one JSON line per (decode loop, rows)."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="smollm2", choices=sorted(fast_mode.CONFIGS))
  p.add_argument("--dtype", default="bfloat16", help="the parameters' and the compute's dtype")
  p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
  p.add_argument("--loops", nargs="+", default=["unroll", "scan"], help="ModelConfig.decode_loop values")
  p.add_argument("--prompt-len", type=int, default=288)
  p.add_argument("--new", type=int, default=128)
  p.add_argument("--decode-steps", type=int, default=16)
  args = p.parse_args()
  cfg = dataclasses.replace(fast_mode.CONFIGS[args.config], param_dtype=args.dtype, compute_dtype=args.dtype)
  params = init_params(cfg, jax.random.key(0))
  bandwidth = HBM_BYTES_PER_S.get(jax.devices()[0].device_kind)
  for loop in args.loops:
    for rows in args.rows:
      record = measure(dataclasses.replace(cfg, decode_loop=loop), params, rows, args.prompt_len, args.new,
                       args.decode_steps, bandwidth)
      print(json.dumps(record), flush=True)


if __name__ == "__main__":
  main()
