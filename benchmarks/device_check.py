"""One-shot accelerator check: kernels, attention TFLOP/s, SmolLM2 SFT and GRPO steps, 1M-token memory, fast modes.

  bash benchmarks/device_check.sh                        # on the GPU machine: every section, under 10 minutes
  bash benchmarks/device_check.sh --smoke                # tiny shapes on CPU (tests/benchmarks/test_device_check.py)
  python benchmarks/device_check.py --section sft [--smoke]   # one section, as the wrapper runs each

The wrapper runs each section in a process of its own under a time limit and
prints what this script prints: one JSON line per figure, each with its
`section`, the device kind, the backend, the JAX version and the load
average; a failure is a line with an `error` field, and the next section
runs. Sections, each reusing the benchmark that measures it:

  env        Python, JAX and the device, and whether each section's modules
             import (the GPU image has no grain or tensorboardX, which these
             sections never import); exit 3 when nothing else can run
  kernels    the Pallas GPU paged kernel against the pure-JAX paged path
             (decode steps and prefill chunks over ragged rows, GQA, a window
             with a soft-cap; attention_gpu.check_paged), then the Pallas GPU
             flash kernel against the float32 reference, forward and
             backward, float32 and bfloat16: GQA, packed segments, a sliding
             window with a soft-cap (attention_gpu.check; tolerances there)
  attention  causal TFLOP/s of the Pallas kernel and of cuDNN through
             jax.nn.dot_product_attention at 4K, 16K and 64K tokens, forward
             and forward+backward (attention_gpu.bench); then at 16K, MHA,
             ptx's kernel beside JAX's Pallas Triton and Mosaic GPU kernels
             and cuDNN (attention_gpu.peers)
  sft        the SFT step of the SmolLM2-135M shape, random weights, bfloat16
             compute, Pallas attention: median tokens/s and MFU after warm-up
             (train.measure)
  memory     the compile-only per-device memory of a 1M-token training step
             on the one GPU against ptx.models.memory_floor
             (long_context.compile_memory)
  grpo       the fused GRPO step (sample, reward, update) of the same model
             through rl_step.make_grpo_step (grpo.ptx_round)
  fast       issue #29's rollout modes on the same model: greedy tokens/s of
             the standard engine, of the engine reading its pages with the
             Pallas paged kernel, n-gram and draft-model speculation, int8
             weights and int8 with n-gram speculation, on the code-editing
             and word-problem workloads, and the measured verify_cost
             (fast_mode.measure); rows print as they come, so a section cut
             off by its limit still gives the modes it finished
  rollout    issue #25's uniform anchor (4 prompts x 4 samples, 64 new tokens,
             the tiny anchor model in float32): static `generate` against the
             engine with the pure-JAX paged path and with the Pallas paged
             kernel, 3 rounds alternated (rollout.rows); on the CPU the engine
             made 0.59-0.81x static, most of the gap its page gathers, which
             the Pallas kernel's in-place reads avoid
  stops      (not in the default run: DEVICE_CHECK_SECTIONS="env:15
             stops:400") issue #25's stops workload on the tiny anchor
             model: 256 requests at the 2,048 cap, ended by the stop id of a
             model trained here (150 SFT steps), static `generate` in batches
             of 16 against the on-demand engine (64 rows, the same KV bytes),
             3 rounds, each its own sampling seed (rollout.rows, --reseed).
             On the CPU the engine made 2.27x static (12-05), bound by its
             page gathers; #25 asks 2.5x
  agent      issue #26's benchmark: 1,024 multi-turn episodes (warm-ups of
             256), 64 at once, with log-uniform 0.1-1 s tools, through the
             episode loop overlapped against the loop in lockstep
             (`play_lockstep`, multi-turn training's default) on the tiny
             anchor model, and the ratio's bound from the tool times alone
             (agent.rows; its lockstep turn-batches ran on the H200 12-04)
  moe        (not in the default run: DEVICE_CHECK_SECTIONS="env:15
             moe:240") issue #54's step times of SFT and the fused GRPO step
             for SmolLM2-135M's shape beside its Mixture-of-Experts twin (8
             experts, 2 per token, the same active MLP width) with the ragged
             (grouped-matmul) experts (moe.measure at moe.py's shapes); the
             issue's goal: the MoE step within 1.5x of the dense one

The sections of issue #27 (all but rollout, fast and agent) take under 8 minutes together.

The GPU image has JAX, Flax, Optax and Orbax but not qwix (a ptx dependency
that int8 rollouts need; ptx.models imports it): carry its wheel and install
it first, e.g. `pip download --no-deps qwix==0.1.8 -d .whl` here, then there
`pip install --no-index --no-deps --target /tmp/site .whl/*.whl` with
PYTHONPATH=/tmp/site. It lacks grain and tensorboardX too, which no section
imports (tests/benchmarks/test_device_check.py checks that).

Where the Pallas model fails (sft, memory, grpo), its error line is followed
by the same measurement with "xla" attention ("blockwise" at 1M tokens), so
the step's other figures still come.

MFU is model FLOP/s over PEAK_TFLOPS, the H200's dense bfloat16 datasheet
figure (989 TFLOP/s; this workplace measured 769-798 on 8192^3 bf16 matmuls).
A GRPO step's model FLOPs are 5/3 of a training step's over its rollout
tokens: the update's forward+backward, the reference log-probs' forward and
the sampler's (prefill and cached decoding do a forward's matmuls). Smoke mode
(`--smoke`) runs every section with tiny shapes on the CPU: the kernel
interpreted, no cuDNN ("skipped: no GPU"), 1-layer models with XLA attention;
its figures only show that the code runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import sys
import time
import traceback

START = time.monotonic()

PEAK_TFLOPS = 989.0  # H200 SXM dense bfloat16, the vendor's datasheet (KINDS.md measured ~790 on matmuls)
# Exit codes the wrapper reads: a section that printed its own error line, and "nothing else can run".
REPORTED, STOP = 2, 3
# The modules each section imports (benchmarks/ is this script's folder, first on sys.path). Sections import them
# themselves, so that a module that fails to import fails its sections alone, and env runs without JAX.
MODULES = {"kernels": ("ptx_kernels", "attention_gpu"), "attention": ("ptx_kernels", "attention_gpu"),
           "sft": ("ptx.models", "train"), "memory": ("long_context",), "grpo": ("ptx.train.grpo.update", "grpo"),
           "rollout": ("ptx.sampling.engine.engine", "rollout"),
           "fast": ("ptx.sampling.engine.speculative", "fast_mode"),
           "stops": ("ptx.sampling.engine.engine", "rollout"), "agent": ("ptx.episodes.loop", "agent"),
           "moe": ("ptx.models.moe", "moe")}


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
    yield from attention_gpu.check(pk.BlockSizes(32, 16), b=1, t=64, d=16, interpret=True, dtypes=("bfloat16",))
  else:
    # The paged kernel first: it has never run compiled (small shapes, quick to compile), then the flash kernel.
    yield from attention_gpu.check_paged()
    yield from attention_gpu.check(None)  # the kernel's default tiles per dtype, as models run it


def attention(smoke: bool):
  """Yields TFLOP/s of Pallas and cuDNN, one row per sequence length; on a GPU, then ptx's against JAX's kernels."""
  import attention_gpu
  import ptx_kernels as pk
  if smoke:
    yield from attention_gpu.bench([128], heads=8, repeats=1, tiles=pk.BlockSizes(32, 16), interpret=True)
  else:
    yield from attention_gpu.bench([4096, 16384, 65536], heads=16, repeats=5, tiles=pk.BlockSizes(128, 64))
    # The H200 run of 12-04 had ptx's kernel at 0.15-0.45 of cuDNN's forward: is it the kernel or Pallas?
    yield attention_gpu.peers(16384, heads=16, repeats=3, tiles=pk.BlockSizes(128, 64))


def _first_working(impls, measure):
  """Yields `measure(impl)`'s row for the first attention impl that works, after an error row for each that fails.

  The models' Pallas attention is the figure wanted; a fallback impl still gives the step's other figures.
  """
  for impl in impls:
    try:
      yield {"attention_impl": impl, **measure(impl)}
      return
    except Exception as e:  # Report, then try the next impl.
      yield {"attention_impl": impl, "error": repr(e)[:800]}


def _smollm2(smoke: bool, attention_impl: str):
  """SmolLM2-135M's shape in bfloat16 compute, or (smoke) a 1-layer tiny model in float32, with `attention_impl`."""
  from ptx.model_config import MODEL_PRESETS
  import ptx.models  # noqa: F401  (registers the presets)
  if smoke:
    return dataclasses.replace(MODEL_PRESETS["tiny"](), n_layers=1, attention_impl=attention_impl)
  return dataclasses.replace(MODEL_PRESETS["smollm2_135m"](), compute_dtype="bfloat16", attention_impl=attention_impl)


def _impls(smoke: bool, fallback: str) -> tuple[str, ...]:
  """Pallas, then `fallback`, on the GPU; XLA attention alone in smoke mode (the CPU has no Pallas model)."""
  return ("xla",) if smoke else ("pallas", fallback)


def sft(smoke: bool):
  """Yields the SFT step's median tokens/s and MFU."""
  import train
  batch, seq_len, warmup, steps = (2, 64, 1, 1) if smoke else (16, 2048, 2, 5)

  def measure(impl):
    cfg = _smollm2(smoke, impl)
    record = train.measure(cfg, batch, seq_len, warmup, steps, PEAK_TFLOPS * 1e3)
    figures = record["sft"]
    return dict(model="tiny" if smoke else "smollm2_135m", compute_dtype=cfg.compute_dtype, batch=batch,
                seq_len=seq_len, n_params=record["n_params"], tokens_per_s=round(figures["tokens_per_s_median"]),
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


def grpo(smoke: bool):
  """Yields the fused GRPO step's median time, tokens/s and MFU."""
  import grpo as grpo_bench
  import train
  prompts, group, prompt_len, new, warmup, steps = (2, 2, 8, 8, 1, 1) if smoke else (8, 8, 128, 128, 1, 3)
  rows, length = prompts * group, prompt_len + new

  def measure(impl):
    cfg = _smollm2(smoke, impl)
    record = grpo_bench.ptx_round(steps, warmup, cfg, prompts, group, prompt_len, new, phases=False)
    seconds = record["step_s_median"]
    flops = train.flops_per_token(cfg, length) * rows * length * 5 / 3  # see the module docstring
    return dict(model="tiny" if smoke else "smollm2_135m", compute_dtype=cfg.compute_dtype, prompts=prompts,
                group=group, prompt_len=prompt_len, new_tokens=new, step_s_median=seconds,
                step_s_min=record["step_s_min"], first_step_s=record["first_step_s"],
                tokens_per_s=round(rows * length / seconds), generated_tokens_per_s=round(rows * new / seconds),
                mfu=round(flops / seconds / (PEAK_TFLOPS * 1e12), 4), peak_tflops=PEAK_TFLOPS, timed_steps=steps,
                response_length_mean=record["response_length_mean"])

  yield from _first_working(_impls(smoke, "xla"), measure)


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
  dense = _smollm2(smoke, "xla" if smoke else "pallas")
  for workload in ("sft", "grpo"):
    base = None
    for name, cfg in moe_bench.models(dense, ["ragged"]).items():
      row = moe_bench.measure(name, cfg, workload, steps, warmup, smoke)
      base = base or row["step_s_median"]
      yield {**row, "over_dense": round(row["step_s_median"] / base, 3)}


SECTIONS = {"env": env, "kernels": kernels, "attention": attention, "sft": sft, "memory": memory, "grpo": grpo,
            "rollout": rollout, "stops": stops, "fast": fast, "agent": agent, "moe": moe}


def main() -> None:
  """Runs one section; an exception becomes its error line and exit code REPORTED."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--section", required=True, choices=list(SECTIONS))
  parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, Pallas interpreted")
  args = parser.parse_args()
  try:
    for row in SECTIONS[args.section](args.smoke):
      _emit(args.section, row)
  except Exception as e:  # One line saying what broke; the wrapper goes on with the next section.
    _emit(args.section, {"error": repr(e)[:800], "traceback": traceback.format_exc()[-1500:]})
    sys.exit(REPORTED)


if __name__ == "__main__":
  main()
