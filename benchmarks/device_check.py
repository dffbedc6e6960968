"""One-shot accelerator check: what a GPU user gets by default (#58 item 4), and the earlier issues' figures.

  bash benchmarks/device_check.sh                        # on the GPU machine: the default sections, under 10 minutes
  bash benchmarks/device_check.sh --smoke                # tiny shapes on CPU (tests/benchmarks/test_device_check.py)
  python benchmarks/device_check.py --section sft [--smoke]   # one section, as the wrapper runs each

The wrapper runs each section in a process of its own under a time limit and
prints what this script prints: one JSON line per figure, each with its
`section`, the device kind, the backend, the JAX version and the load
average; a failure is a line with an `error` field, and the next section
runs. Sections, each reusing the benchmark that measures it (the wrapper's
comment says which run by default and why):

  env        Python, JAX and the device, and whether each section's modules
             import (the GPU image has no grain or tensorboardX, which these
             sections never import); exit 3 when nothing else can run
  attention  causal GQA bfloat16 TFLOP/s at 4K and 16K tokens, forward and
             forward+backward, of ptx's default attention as a model runs it
             (`ptx.models.attention.attention`, impl "auto") over rows
             declared packed and right-padded (each row names what "auto"
             resolved to for each, `default_<rows>_impl`: ptx's Pallas kernel
             and cuDNN by today's table) against cuDNN through
             jax.nn.dot_product_attention (attention_gpu.bench); then at 16K,
             MHA, ptx's Pallas kernel beside JAX's Pallas Triton and Mosaic
             GPU kernels and cuDNN (attention_gpu.peers). On a TPU the
             reference would be JAX's splash attention; the check runs on
             GPUs only (env), so no line names it
  sft        the SFT step of the SmolLM2-135M shape, random weights, bfloat16
             compute, the default attention for packed rows (DataConfig's
             default; the row names the table's choice and reason): median
             tokens/s and MFU after warm-up (train.measure)
  sft_1b     the same at the Llama-3.2-1B shape (its preset: bfloat16
             parameters and compute), 4 x 2,048 tokens a step (`LLAMA_1B`)
  grpo       the fused GRPO step (sample, reward, update) of the SmolLM2
             shape through rl_step.make_grpo_step (grpo.ptx_round)
  grpo_1b    the same at the Llama-3.2-1B shape, 4 prompts x 8
  decode     the rollout engine's decode tokens/s of the SmolLM2 shape in
             bfloat16 at 16, 64 and 256 rows (288-token prompts, 128 new
             tokens), for each `ModelConfig.decode_loop` ("unroll", "scan"),
             against the HBM-bandwidth roofline: (weight bytes + KV bytes a
             step reads) / the device's bandwidth (decode_roofline.measure)
  tile_runs  the Pallas GPU kernel rewrite that 188eb02 reverted
             (benchmarks/candidates/pallas_gpu_tile_runs.py), run in the
             current kernel's place: the correctness check the current kernel
             passes (attention_gpu.check, bfloat16 then float32, the default
             tiles), each case in a child process that is killed after
             CASE_LIMIT_S, so a hang is a line and the other cases still run;
             then, if every case passed, bfloat16 TFLOP/s at 4K and 16K
             against the current kernel (attention_gpu.bench)
  decode_1b  (not in the default run) `decode` at the Llama-3.2-1B shape
  kernels    (not in the default run) the Pallas GPU paged kernel against
             the pure-JAX paged path (decode steps and prefill chunks over
             ragged rows, GQA, a window with a soft-cap;
             attention_gpu.check_paged), then the Pallas GPU flash kernel
             against the float32 reference, forward and backward, float32
             and bfloat16: GQA, packed segments, a sliding window with a
             soft-cap (attention_gpu.check; tolerances there)
  memory     (not in the default run) the compile-only per-device memory of
             a 1M-token training step on the one GPU against
             ptx.models.memory_floor (long_context.compile_memory)
  fast       (not in the default run) issue #29's rollout modes on the
             SmolLM2 shape: greedy tokens/s of the standard engine, of the
             engine reading its pages with the Pallas paged kernel, n-gram
             speculation, int8 weights and int8 with n-gram speculation, on
             the code-editing and word-problem workloads, and the measured
             verify_cost (fast_mode.measure); rows print as they come, so a
             section cut off by its limit still gives the modes it finished
  rollout    (not in the default run) issue #25's uniform anchor (4 prompts
             x 4 samples, 64 new tokens, the tiny anchor model in float32):
             static `generate` against the engine with the pure-JAX paged
             path and with the Pallas paged kernel, 3 rounds alternated
             (rollout.rows); on the CPU the engine made 0.59-0.81x static,
             most of the gap its page gathers, which the Pallas kernel's
             in-place reads avoid
  stops      (not in the default run: DEVICE_CHECK_SECTIONS="env:15
             stops:400") issue #25's stops workload on the tiny anchor
             model: 256 requests at the 2,048 cap, ended by the stop id of a
             model trained here (150 SFT steps), static `generate` in batches
             of 16 against the on-demand engine (64 rows, the same KV bytes),
             3 rounds, each its own sampling seed (rollout.rows, --reseed).
             On the CPU the engine made 2.27x static (12-05), bound by its
             page gathers; #25 asks 2.5x
  agent      (not in the default run) issue #26's benchmark: 1,024
             multi-turn episodes (warm-ups of 256), 64 at once, with
             log-uniform 0.1-1 s tools, through the episode loop overlapped
             against the loop in lockstep (`play_lockstep`, multi-turn
             training's default) on the tiny anchor model, and the ratio's
             bound from the tool times alone (agent.rows; its lockstep
             turn-batches ran on the H200 12-04)
  moe        (not in the default run: DEVICE_CHECK_SECTIONS="env:15
             moe:240") issue #54's step times of SFT and the fused GRPO step
             for SmolLM2-135M's shape beside its Mixture-of-Experts twin (8
             experts, 2 per token, the same active MLP width) with the ragged
             (grouped-matmul) experts (moe.measure at moe.py's shapes); the
             issue's goal: the MoE step within 1.5x of the dense one

The GPU image has JAX, Flax, Optax and Orbax but not qwix (a ptx dependency
that int8 rollouts need; ptx.models imports it): carry its wheel and install
it first, e.g. `pip download --no-deps qwix==0.1.8 -d .whl` here, then there
`pip install --no-index --no-deps --target /tmp/site .whl/*.whl` with
PYTHONPATH=/tmp/site. It lacks grain and tensorboardX too, which no section
imports (tests/benchmarks/test_device_check.py checks that).

Where the default attention fails (sft, memory, grpo), its error line is
followed by the same measurement with "xla" attention ("blockwise" at 1M
tokens), so the step's other figures still come.

MFU is model FLOP/s over PEAK_TFLOPS, the dense bfloat16 datasheet figure
of the H100 SXM and of the H200 (989 TFLOP/s; this workplace measured
769-798 on 8192^3 bf16 matmuls on the H200). A GRPO step's model FLOPs are
5/3 of a training step's over its rollout tokens: the update's
forward+backward, the reference log-probs' forward and the sampler's
(prefill and cached decoding do a forward's matmuls). Smoke mode
(`--smoke`) runs every section with tiny shapes on the CPU: the kernels
interpreted, no cuDNN ("skipped: no GPU"), 1-layer cuts of the models at
the tiny preset's widths; its figures only show that the code runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import platform
import selectors
import subprocess
import sys
import time
import traceback

START = time.monotonic()

PEAK_TFLOPS = 989.0  # H100 SXM and H200 dense bfloat16, the vendor's datasheets (KINDS.md measured ~790 on matmuls)
# Exit codes the wrapper reads: a section that printed its own error line, and "nothing else can run".
REPORTED, STOP = 2, 3
# The fields `_emit` adds to every line.
CONTEXT = ("section", "device", "backend", "jax", "load", "elapsed_s")
# The modules each section imports (benchmarks/ is this script's folder, first on sys.path). Sections import them
# themselves, so that a module that fails to import fails its sections alone, and env runs without JAX.
MODULES = {"kernels": ("ptx_kernels", "attention_gpu"), "attention": ("ptx.models.attention", "attention_gpu"),
           "sft": ("ptx.models", "train"), "sft_1b": ("ptx.models", "train"),
           "memory": ("long_context",), "grpo": ("ptx.train.grpo.update", "grpo"),
           "grpo_1b": ("ptx.train.grpo.update", "grpo"), "decode": ("ptx.sampling.engine.engine", "decode_roofline"),
           "decode_1b": ("ptx.sampling.engine.engine", "decode_roofline"),
           "tile_runs": ("attention_gpu", "candidates.pallas_gpu_tile_runs"),
           "rollout": ("ptx.sampling.engine.engine", "rollout"),
           "fast": ("ptx.sampling.engine.speculative", "fast_mode"),
           "stops": ("ptx.sampling.engine.engine", "rollout"), "agent": ("ptx.episodes.loop", "agent"),
           "moe": ("ptx.models.moe", "moe")}


@dataclasses.dataclass(frozen=True)
class Shape:
  """A model the step sections time, and each step's work."""

  # A ptx.model_config.MODEL_PRESETS name.
  preset: str
  # SFT rows and tokens per row.
  sft: tuple[int, int]
  # GRPO prompts, samples per prompt, prompt tokens, new tokens.
  grpo: tuple[int, int, int, int]


SMOLLM2 = Shape("smollm2_135m", sft=(16, 2048), grpo=(8, 8, 128, 128))
# Llama-3.2-1B (its preset's bfloat16 parameters and compute) at 8,192 tokens a step, to fit an H100's 80 GB:
# XLA:CPU's compile of its SFT step holds 6.9 GiB of arguments and 35 GiB of temporaries at 4 x 2,048 (62 GiB at
# 8 x 2,048); GRPO's update takes as many tokens (32 rows of 256).
LLAMA_1B = Shape("llama3_2_1b", sft=(4, 2048), grpo=(4, 8, 128, 128))
# Smoke mode's models: each preset cut to one layer at the tiny preset's widths (keeping its dtypes, tied
# embeddings and RoPE), and its steps' work.
SMOKE_WIDTHS = dict(vocab_size=512, d_model=128, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=384)
SMOKE_SFT, SMOKE_GRPO = (2, 64), (2, 2, 8, 8)
# The kernel checks' smoke shapes: tiles, batch, length and head width the Pallas interpreter runs in seconds.
SMOKE_CHECK = dict(b=1, t=64, d=16, interpret=True)
SMOKE_TILES = (32, 16)
# Seconds each case of the tile_runs check may take in its child process (start-up included for a child's first):
# the current kernel's cases took 5-20 s in bfloat16 and 13-31 s in float32 at its default tiles (H200, 12-04).
CASE_LIMIT_S = 60


def _context() -> dict:
  """The fields every line carries: device kind, backend, JAX version, load average."""
  import jax
  return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
          "load": round(os.getloadavg()[0], 2)}


def _emit(section: str, row: dict) -> None:
  """Prints one JSON line of `section`, with the seconds since the section's process started."""
  elapsed = round(time.monotonic() - START, 1)
  print(json.dumps({"section": section, **_context(), "elapsed_s": elapsed, **row}, default=str), flush=True)


def _stop(row: dict, error: str) -> None:
  """Prints the env line that ends the run (without the context fields, which may not exist) and exits STOP."""
  print(json.dumps({"section": "env", **row, "error": error, "load": round(os.getloadavg()[0], 2)}), flush=True)
  sys.exit(STOP)


def env(smoke: bool):
  """Yields the environment line; exits STOP when JAX, its devices or (outside smoke mode) a GPU are missing."""
  row = {"python": platform.python_version(), "executable": sys.executable, "smoke": smoke}
  try:
    import jax
    devices = jax.devices()
  except Exception as e:  # The one line a machine without a working JAX gets.
    _stop({**row, "missing": ["jax"]}, f"jax does not start: {e!r}")
  versions = {}
  for name in ("jaxlib", "flax", "optax", "orbax.checkpoint", "numpy", "grain", "tensorboardX"):
    try:  # grain and tensorboardX are ptx dependencies the GPU image lacks; no section imports them.
      versions[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception:
      versions[name] = None
  imports = {}
  for section, modules in MODULES.items():
    try:
      for name in modules:
        importlib.import_module(name)
      imports[section] = "ok"
    except Exception as e:  # Which section will fail, and on what, before it runs.
      imports[section] = repr(e)[:200]
  stats = devices[0].memory_stats() or {}
  row.update(devices=len(devices), memory_gib=round(stats.get("bytes_limit", 0) / 2**30, 1), versions=versions,
             imports=imports)
  if not smoke and jax.default_backend() != "gpu":
    _stop({**row, **_context()}, f"no GPU: JAX's backend is {jax.default_backend()!r}")
  yield row


def kernels(smoke: bool):
  """Yields the Pallas kernel's errors against the reference, per case, dtype and kernel."""
  import attention_gpu
  import ptx_kernels as pk
  if smoke:
    yield from attention_gpu.check_paged(t_new=(1,), rows=2, pages_per_row=2, d=16, interpret=True,
                                         dtypes=("float32",))
    # One case: tile_runs' smoke run checks every case through the same function.
    yield from attention_gpu.check(pk.BlockSizes(*SMOKE_TILES), **SMOKE_CHECK, dtypes=("bfloat16",),
                                   cases=("gqa_causal",))
  else:
    # The paged kernel first: it has never run compiled (small shapes, quick to compile), then the flash kernel.
    yield from attention_gpu.check_paged()
    yield from attention_gpu.check(None)  # the kernel's default tiles per dtype, as models run it


def attention(smoke: bool):
  """Yields TFLOP/s of ptx's default attention and cuDNN's, one row per length; on a GPU, then ptx's kernel against
  JAX's kernels."""
  import attention_gpu
  import jax
  import ptx_kernels as pk
  from ptx.models.attention_choice import ROW_LAYOUTS
  seq_lens, heads, repeats = ([128], 8, 1) if smoke else ([4096, 16384], 16, 5)
  # The default for each row layout a model declares (DataConfig.rows): packed rows (packed SFT, the default, and
  # GRPO) and right-padded ones (unpacked SFT, DPO), which cuDNN may take.
  kernels = {f"default_{rows}": attention_gpu.model_default(rows) for rows in ROW_LAYOUTS}
  on_gpu = jax.default_backend() == "gpu"
  if on_gpu:
    kernels["cudnn"] = attention_gpu.cudnn
  for row in attention_gpu.bench(seq_lens, heads, repeats, kernels, reference="cudnn"):
    yield {**row, **{f"default_{rows}_impl": attention_gpu.default_impl(row["seq_len"], row["head_dim"], rows)
                     for rows in ROW_LAYOUTS}, **({} if on_gpu else {"cudnn": "skipped: no GPU"})}
  if on_gpu:
    # The H200 run of 12-04 had ptx's kernel at 0.15-0.45 of cuDNN's forward: is it the kernel or Pallas?
    yield attention_gpu.peers(16384, heads=16, repeats=3, tiles=pk.BlockSizes(128, 64))


def _first_working(impls, measure):
  """Yields `measure(impl)`'s row for the first attention impl that works, after an error row for each that fails.

  The models' default attention is the figure wanted; a fallback impl still gives the step's other figures.
  """
  for impl in impls:
    try:
      yield {"attention_impl": impl, **measure(impl)}
      return
    except Exception as e:  # Report, then try the next impl.
      yield {"attention_impl": impl, "error": repr(e)[:800]}


def _model(shape: Shape, smoke: bool, attention_impl: str):
  """`shape`'s preset with bfloat16 compute and `attention_impl`; in smoke mode its 1-layer cut (SMOKE_WIDTHS)."""
  from ptx.model_config import MODEL_PRESETS
  import ptx.models  # noqa: F401  (registers the presets)
  cfg = dataclasses.replace(MODEL_PRESETS[shape.preset](), compute_dtype="bfloat16", attention_impl=attention_impl)
  return dataclasses.replace(cfg, **SMOKE_WIDTHS) if smoke else cfg


def _attention_row(cfg, seq_len: int) -> dict:
  """The attention a training step of `seq_len` tokens runs on one device, and the dispatch table's reason.

  train.measure's and grpo.ptx_round's rows are "packed" (sft.loss's default and DataConfig's, and GRPO's).
  """
  from ptx import sharding
  from ptx.models import decoder
  impl, reason = decoder.attention_row(cfg, seq_len, "packed", sharding.DEFAULT_RULES)
  return {"attention_resolved": impl, "attention_reason": reason}


def _impls(smoke: bool, fallback: str) -> tuple[str, ...]:
  """The default ("auto"), then `fallback`, on the GPU; the default alone in smoke mode."""
  return ("auto",) if smoke else ("auto", fallback)


def sft(smoke: bool, shape: Shape = SMOLLM2):
  """Yields the SFT step's median tokens/s and MFU at `shape`."""
  import train
  batch, seq_len = SMOKE_SFT if smoke else shape.sft
  warmup, steps = (1, 1) if smoke else (2, 5)

  def measure(impl):
    cfg = _model(shape, smoke, impl)
    record = train.measure(cfg, batch, seq_len, warmup, steps, PEAK_TFLOPS * 1e3)
    figures = record["sft"]
    return dict(model=shape.preset, n_layers=cfg.n_layers, **_attention_row(cfg, seq_len),
                param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype, batch=batch, seq_len=seq_len,
                n_params=record["n_params"], tokens_per_s=round(figures["tokens_per_s_median"]),
                step_s_median=round(figures["step_s_median"], 4), step_s_min=round(figures["step_s_min"], 4),
                first_step_s=round(figures["first_step_s"], 2), mfu=round(figures["mfu"], 4),
                peak_tflops=PEAK_TFLOPS, loss_first=figures["loss_first"], loss_last=figures["loss_last"],
                timed_steps=steps)

  yield from _first_working(_impls(smoke, "xla"), measure)


def memory(smoke: bool):
  """Yields the compile-only memory of a 1M-token training step on one device, against the floor."""
  import jax
  import long_context
  cfg, tokens = (long_context.MODEL_CPU, 1024) if smoke else (long_context.MODEL_1M_GPU, 2**20)
  # Blockwise is the fallback: XLA's [T, T] logits cannot exist at 1M tokens.
  yield from _first_working(_impls(smoke, "blockwise"), lambda impl: long_context.compile_memory(
      dataclasses.replace(cfg, attention_impl=impl), tokens, 1, jax.devices()[:1]))


def grpo(smoke: bool, shape: Shape = SMOLLM2):
  """Yields the fused GRPO step's median time, tokens/s and MFU at `shape`."""
  import grpo as grpo_bench
  import train
  prompts, group, prompt_len, new = SMOKE_GRPO if smoke else shape.grpo
  warmup, steps = (1, 1) if smoke else (1, 3)
  rows, length = prompts * group, prompt_len + new

  def measure(impl):
    cfg = _model(shape, smoke, impl)
    record = grpo_bench.ptx_round(steps, warmup, cfg, prompts, group, prompt_len, new, phases=False)
    seconds = record["step_s_median"]
    flops = train.flops_per_token(cfg, length) * rows * length * 5 / 3  # see the module docstring
    return dict(model=shape.preset, n_layers=cfg.n_layers, **_attention_row(cfg, length),
                param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype, prompts=prompts, group=group,
                prompt_len=prompt_len, new_tokens=new, step_s_median=seconds, step_s_min=record["step_s_min"],
                first_step_s=record["first_step_s"], tokens_per_s=round(rows * length / seconds),
                generated_tokens_per_s=round(rows * new / seconds),
                mfu=round(flops / seconds / (PEAK_TFLOPS * 1e12), 4), peak_tflops=PEAK_TFLOPS, timed_steps=steps,
                response_length_mean=record["response_length_mean"])

  yield from _first_working(_impls(smoke, "xla"), measure)


def decode(smoke: bool, shape: Shape = SMOLLM2):
  """Yields the engine's decode tokens/s against the HBM roofline at each row count, per decode loop."""
  import decode_roofline
  import jax
  from ptx.models import init_params
  # The engine compiles a decode program per (rows, decode loop) and a prefill program per decode loop: ~15 s
  # each for the SmolLM2 shape on the H200 (fast mode's engines, 12-04), so 8 programs. decode_roofline says why
  # these prompt and generation lengths compile one decode program each.
  rows, prompt_len, new, steps = ((2,), 24, 8, 4) if smoke else ((16, 64, 256), 288, 128, 16)
  cfg = dataclasses.replace(_model(shape, smoke, "auto"), param_dtype="bfloat16")
  params = init_params(cfg, jax.random.key(0))
  bandwidth = decode_roofline.HBM_BYTES_PER_S.get(jax.devices()[0].device_kind)
  for loop in ("unroll", "scan"):
    for n in rows:
      yield {"model": shape.preset, "n_layers": cfg.n_layers, **decode_roofline.measure(
          dataclasses.replace(cfg, decode_loop=loop), params, n, prompt_len, new, steps, bandwidth)}


def _rows_within(fd: int, limit_s: float):
  """Yields the JSON rows a child prints on `fd`, one a line, until it closes it; then None if the child was silent
  for `limit_s` since its start or its last row (it is still running: a hang, or a compile past the limit)."""
  selector = selectors.DefaultSelector()
  selector.register(fd, selectors.EVENT_READ)
  buffered, deadline = b"", time.monotonic() + limit_s
  while True:
    line, newline, rest = buffered.partition(b"\n")
    if newline:
      buffered = rest
      yield json.loads(line)
      deadline = time.monotonic() + limit_s
    elif not selector.select(max(deadline - time.monotonic(), 0)):
      yield None
      return
    else:
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        return
      buffered += chunk


def _each_within(argv, names, limit_s: float, env: dict):
  """Yields (name, row) for each of `names`, run in order by child processes that print one JSON row per name.

  `argv(pending)` is the command of a child that runs the names `pending`. A name whose row does not come within
  `limit_s` of the row before (or of its child's start) gets an error row; its child is killed and a new one runs
  the names after it. So does a name whose child exits before its row.
  """
  pending = list(names)
  while pending:
    child = subprocess.Popen(argv(pending), stdout=subprocess.PIPE, env=env)
    try:
      for row in _rows_within(child.stdout.fileno(), limit_s):
        if row is None:
          error = f"no result within {limit_s} s: killed (a hang, or a compile past the limit)"
          break
        yield pending.pop(0), row
        if not pending:  # done: killed below, so a process that hangs at exit (JAX on the H200, 12-04) costs nothing
          break
      else:
        try:
          code = child.wait(timeout=10)
        except subprocess.TimeoutExpired:
          code = None
        error = f"its process stopped printing (exit code {code}) before this case"
    finally:
      child.kill()
      child.wait()
    if pending:
      yield pending.pop(0), {"error": error}


def tile_runs(smoke: bool):
  """Yields the candidate kernel's check rows (each case in a child process, killed after CASE_LIMIT_S), then, if
  every case passed, its bfloat16 TFLOP/s against the current kernel's."""
  import attention_gpu
  import ptx_kernels as pk
  from candidates import pallas_gpu_tile_runs
  children = dict(os.environ)
  # This process starts JAX for its lines' context while the children check: without preallocating, it leaves
  # the GPU's memory to them (JAX takes 75% of it at start otherwise).
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  passed = True
  # bfloat16 first: the dtype timed, and the quicker to compile. Smoke mode checks float32 alone, the stricter
  # tolerance, in one child process.
  for dtype in ("float32",) if smoke else ("bfloat16", "float32"):
    def argv(cases, dtype=dtype):
      return [sys.executable, os.path.abspath(__file__), "--section", "tile_runs", "--dtype", dtype,
              "--cases", *cases] + (["--smoke"] if smoke else [])
    for case, row in _each_within(argv, attention_gpu.CASES, 300 if smoke else CASE_LIMIT_S, children):
      row = {"bench": "attention_gpu_check", "case": case, "impl": "tile_runs", "dtype": dtype,
             **{key: value for key, value in row.items() if key not in CONTEXT}}
      passed = passed and row.get("ok", False)
      yield row
  if not passed:
    yield {"bench": "attention_gpu", "timing": "skipped: a case failed or did not finish"}
    return
  tiles = pk.BlockSizes(*SMOKE_TILES) if smoke else pk.BlockSizes(128, 64)  # bfloat16's default tiles
  current = functools.partial(attention_gpu.pallas, tiles, interpret=smoke)
  kernels = {"pallas_gpu": current, "tile_runs": attention_gpu.with_gpu_kernel(pallas_gpu_tile_runs, current)}
  seq_lens, heads, repeats = ([64], 8, 1) if smoke else ([4096, 16384], 16, 3)
  for row in attention_gpu.bench(seq_lens, heads, repeats, kernels, reference="pallas_gpu"):
    yield {**row, "block_q": tiles.block_q, "block_kv": tiles.block_kv}


def _tile_runs_cases(smoke: bool, dtype: str, cases: list[str]):
  """Yields the candidate kernel's check rows of `cases` in `dtype`: a child process of the tile_runs section."""
  import attention_gpu
  import ptx_kernels as pk
  from candidates import pallas_gpu_tile_runs
  shapes = dict(tiles=pk.BlockSizes(*SMOKE_TILES), **SMOKE_CHECK) if smoke else dict(tiles=None)
  with attention_gpu.gpu_kernel(pallas_gpu_tile_runs):
    for row in attention_gpu.check(**shapes, dtypes=(dtype,), cases=cases, with_cudnn=False):
      yield {**row, "impl": "tile_runs"}


def rollout(smoke: bool):
  """Yields rollout.py's rows on the uniform anchor: each run of each method, then the summary with the ratios."""
  import rollout as rollout_bench
  # The engine compiles a prefill and a decode program per (rows, pairs) bucket: four buckets here, where the
  # long-tailed workloads take dozens (68 s of compiling on the CPU), so they stay off the device's clock.
  argv = ["--config", "tiny", "--workloads", "uniform", "--rounds", "1" if smoke else "3",
          "--methods", "static,engine" if smoke else "static,engine,engine_pallas"]
  yield from rollout_bench.rows(rollout_bench.parser().parse_args(argv))


def stops(smoke: bool):
  """Yields rollout.py's rows on the stops workload: each run of static and the on-demand engine, then the summary."""
  import rollout as rollout_bench
  argv = ["--config", "tiny", "--workloads", "stops", "--methods", "static,engine_on_demand", "--reseed",
          "--static-warmup", "compile"]
  if smoke:  # 8 requests to a cap of 64, a stop model of 2 steps
    argv += ["--requests", "8", "--p99", "64", "--median", "16", "--train-steps", "2", "--rounds", "1"]
  else:
    argv += ["--rounds", "3"]
  yield from rollout_bench.rows(rollout_bench.parser().parse_args(argv))


def fast(smoke: bool):
  """Yields fast_mode's rows: tokens/s per (workload, mode), then the calibration row."""
  import fast_mode
  if smoke:
    argv = ["--config", "tiny", "--requests", "2", "--new", "8", "--workloads", "code_edit",
            "--modes", "standard,ngram_always,int8_ngram"]
  else:
    # Each mode compiles its engine's programs (40-60 s each on the H200, 12-04): the four that answer #29's
    # question, code editing first. draft_model is left out: with random weights its cut of the policy accepts
    # almost nothing (0.008 there), so its figure says nothing a trained draft would.
    argv = ["--config", "smollm2", "--compute-dtype", "bfloat16", "--requests", "16", "--new", "128",
            "--modes", "standard,pallas,ngram,int8,int8_ngram"]
  args = fast_mode.parser().parse_args(argv)
  yield from fast_mode.measure(*fast_mode.model(args), args)


def agent(smoke: bool):
  """Yields benchmarks/agent.py's rows: multi-turn episodes with slow tools, overlapped against the loop in lockstep."""
  import agent as agent_bench
  if smoke:
    argv = ["--episodes", "8", "--concurrent", "4", "--turns", "1", "--tool-min", "0.01", "--tool-max", "0.02",
            "--turn-tokens", "8", "--context", "128", "--rounds", "1", "--max-warmups", "1",
            "--methods", "overlap,play_lockstep"]
  else:
    # One round: warm-ups of 256 episodes, then 1,024 timed (16 per slot, where the tools allow 2.25x; 256 allow
    # only 1.91x, the tail of a short batch). A GPU decodes the anchor model far faster than the tools answer, so
    # the ratio shows how near the tool bound the loop gets. About 26 s of tool time overlapped, 47 in lockstep.
    argv = ["--tool-dist", "loguniform", "--episodes", "1024", "--warmup-episodes", "256", "--rounds", "1",
            "--max-warmups", "1", "--methods", "overlap,play_lockstep"]
  yield from agent_bench.rows(agent_bench.parser().parse_args(argv))


def moe(smoke: bool):
  """Yields the SFT and GRPO step times of SmolLM2's shape and of its MoE twin, each with its ratio to dense."""
  import moe as moe_bench
  steps, warmup = (1, 1) if smoke else (5, 2)
  dense = _model(SMOLLM2, smoke, "xla" if smoke else "pallas")
  for workload in ("sft", "grpo"):
    base = None
    for name, cfg in moe_bench.models(dense, ["ragged"]).items():
      row = moe_bench.measure(name, cfg, workload, steps, warmup, smoke)
      base = base or row["step_s_median"]
      yield {**row, "over_dense": round(row["step_s_median"] / base, 3)}


SECTIONS = {"env": env, "kernels": kernels, "attention": attention, "sft": sft,
            "sft_1b": functools.partial(sft, shape=LLAMA_1B), "memory": memory, "grpo": grpo,
            "grpo_1b": functools.partial(grpo, shape=LLAMA_1B), "decode": decode,
            "decode_1b": functools.partial(decode, shape=LLAMA_1B), "tile_runs": tile_runs, "rollout": rollout,
            "stops": stops, "fast": fast, "agent": agent, "moe": moe}


def main() -> None:
  """Runs one section; an exception becomes its error line and exit code REPORTED."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--section", required=True, choices=list(SECTIONS))
  parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, Pallas interpreted")
  parser.add_argument("--cases", nargs="+", help="tile_runs only: check these of attention_gpu.CASES with the "
                      "candidate kernel, in this process (the section's child processes)")
  parser.add_argument("--dtype", default="bfloat16", help="with --cases: the inputs' dtype")
  args = parser.parse_args()
  if args.cases and args.section != "tile_runs":
    parser.error("--cases runs the tile_runs section's checks; give --section tile_runs")
  rows = _tile_runs_cases(args.smoke, args.dtype, args.cases) if args.cases else SECTIONS[args.section](args.smoke)
  try:
    for row in rows:
      _emit(args.section, row)
  except Exception as e:  # One line saying what broke; the wrapper goes on with the next section.
    _emit(args.section, {"error": repr(e)[:800], "traceback": traceback.format_exc()[-1500:]})
    sys.exit(REPORTED)


if __name__ == "__main__":
  main()
