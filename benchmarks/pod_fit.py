"""Pod fit: every recipe's pod preset compiled for its pod on fake CPU devices, one JSON line per preset.

  python benchmarks/pod_fit.py                                     # every pod preset, one process each
  python benchmarks/pod_fit.py --recipe sft_chat --preset llama3_8b

Compile only (`ptx.train.pod_fit.check`): the preset's Job, built with the
recipe's builder, is compiled for the mesh of its pod's chip count (a process
faking exactly that many CPU devices, set before JAX starts) from abstract
inputs; no weight is allocated. Each line gives per-device GiB of the
parameters, optimizer state, reference and whole state (exact, from the
shardings), each program's inputs, scratch and outputs (XLA:CPU's figures,
typically high for bfloat16: see `ptx.train.pod_fit`), batches in flight,
the total against the chip's HBM, the verdict and the compile seconds, with
the load average. A closing line sums up.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import runpy
import subprocess
import sys
import time

RECIPES = pathlib.Path(__file__).resolve().parents[1] / "recipes"
# Each pod preset: the slice its recipe's header launches it on, the builder of its Job, the model preset that stands
# for --model-dir's architecture where the preset takes it from the checkpoint alone, and the launch line's overrides.
PODS = {
    ("sft_chat", "llama3_8b"): ("v5p-32", "sft", None, ()),
    ("dpo", "llama3_8b"): ("v5p-32", "dpo", None, ()),
    ("grpo_math", "qwen7b"): ("v5p-64", "grpo_host", None, ()),
    ("grpo_code", "qwen7b"): ("v5p-64", "grpo_host", None, ()),
    ("long_context_sft", "llama3_8b_128k"): ("v5p-64", "sft", None, ()),
    ("grpo_smollm2", "full"): ("v5e-8", "grpo", "smollm2_135m", ("--data.batch_size=64", "--grpo.group_size=16")),
    ("grpo_moe", "qwen3_30b_a3b"): ("v5p-64", "grpo_host", None, ()),
    ("sft_chat", "qwen3_235b_a22b"): ("v5p-128", "sft", None, ()),
    ("sft_chat", "kimi_k2"): ("v5p-1024", "sft", None, ()),
    ("grpo_moe", "kimi_k2"): ("v5p-1024", "grpo_host", None, ()),
    ("grpo_moe", "gpt_oss_20b"): ("v5p-8", "grpo_host", None, ()),
}


def config(recipe: str, preset: str):
  """The Config a pod preset launches with: the recipe's preset, --model-dir's architecture, the launch overrides."""
  import ptx
  from ptx import model_config

  _, _, architecture, overrides = PODS[recipe, preset]
  if str(RECIPES) not in sys.path:  # recipes import `launch` from their folder
    sys.path.insert(0, str(RECIPES))
  cfg = runpy.run_path(str(RECIPES / f"{recipe}.py"), run_name="pod_fit")["PRESETS"][preset]()
  if architecture is not None:  # what --model-dir's config.json brings (`ptx.train.pretrained.configure`)
    cfg = dataclasses.replace(cfg, model=model_config.with_architecture(cfg.model, ptx.presets[architecture]()))
  return ptx.apply_overrides(cfg, list(overrides))


def measure(recipe: str, preset: str) -> dict:
  """The pod-fit record of one preset; this process must fake the pod's chips (`main` sets them)."""
  import ptx
  from ptx.train import pod_fit

  slice_name, algorithm, _, _ = PODS[recipe, preset]
  cfg = config(recipe, preset)
  tokenizer = ptx.ByteTokenizer()  # the job reads only its eos and pad ids
  build = {"sft": ptx.sft_job, "dpo": ptx.dpo_job, "grpo": ptx.grpo_job,
           "grpo_host": lambda c, t: ptx.grpo_host_job(c, t, _never_called)}[algorithm]
  fit = pod_fit.check(cfg, build(cfg, tokenizer), pod_fit.tpu_slice(slice_name))
  return {"bench": "pod_fit", "recipe": recipe, "preset": preset, "pod": slice_name, **fit.record(),
          "load": round(os.getloadavg()[0], 2)}


def _never_called(tokens, lengths, tasks):
  """The host reward of a compile-only check: no step runs, so nothing is scored."""
  raise AssertionError("pod_fit runs no step")


def main():
  """One preset in this process (--recipe, --preset), or every preset in a process of its own."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--recipe", choices=sorted({r for r, _ in PODS}))
  parser.add_argument("--preset")
  args = parser.parse_args()
  if args.recipe is not None:
    if (args.recipe, args.preset) not in PODS:
      parser.error(f"no pod preset {args.recipe} --preset {args.preset}; known: {sorted(PODS)}")
    import jax

    from ptx.train import pod_fit

    # Before JAX starts: the pod's chips as CPU devices, whatever accelerator this machine has.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", pod_fit.tpu_slice(PODS[args.recipe, args.preset][0]).chips)
    jax.config.update("jax_enable_compilation_cache", False)  # compile_s is a compile, not a cache read
    jax.config.update("jax_threefry_partitionable", True)  # as every entry point pins it (STYLE 17)
    print(json.dumps(measure(args.recipe, args.preset)), flush=True)
    return
  started, records = time.perf_counter(), []
  for recipe, preset in PODS:
    out = subprocess.run([sys.executable, __file__, "--recipe", recipe, "--preset", preset], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    records.append(json.loads(out.splitlines()[-1]))
    print(out.splitlines()[-1], flush=True)
  print(json.dumps({"summary": {"fit": [f"{r['recipe']}:{r['preset']}" for r in records if r["fits"]],
                                "do_not_fit": [f"{r['recipe']}:{r['preset']}" for r in records if not r["fits"]],
                                "wall_s": round(time.perf_counter() - started, 1)}}), flush=True)


if __name__ == "__main__":
  main()
