"""LoRA against full fine-tuning: optimizer-state memory and reached loss; prints JSON lines.

  .venv/bin/python benchmarks/lora.py                       # both parts
  .venv/bin/python benchmarks/lora.py --part memory --model=llama3_2_1b

Memory (compile only, nothing is allocated): the SFT train step of a preset
(default SmolLM2-135M, batch 4 x 256) is jitted as in training, once with all
parameters trained and once with LoRA adapters on all seven projections,
and lowered on ShapeDtypeStructs. One line per mode gives the exact bytes
of the optimizer state, trained parameters and frozen base (from
`jax.eval_shape` of the state) and the compiled program's
`memory_analysis()` (arguments, outputs, aliased, temporaries).

Loss: the tiny preset learns addition of 1-2 digit numbers by full SFT (the
"pretrained" base), then learns addition of up to 3-digit numbers (same
tokens, a new skill) from that base twice, once fully fine-tuned and once
with rank-8 LoRA on all projections, same data, batches and steps; each with
its own learning rate. The line reports both held-out losses and
whether LoRA is within the stated margin (--margin, default 0.05 nats per
answer token) of full fine-tuning.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import numpy as np

from ptx.algorithms import sft
from ptx.config import LoRAConfig, MeshConfig, OptimizerConfig
from ptx.model_config import MODEL_PRESETS, ModelConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.batch import pad_batch, sft_example
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import count_params
from ptx.models.params import weight_decay_mask
from ptx.sharding import batch_sharding, make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.state import init_state, initial_params, state_shardings
from ptx.train.step import make_train_step, model_params

ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _bytes(tree) -> int:
  return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def memory(model: ModelConfig, lora: LoRAConfig, batch: int, seq: int) -> list[dict]:
  """Exact state bytes and compiled memory of the full and the LoRA train step (compile only)."""
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=1), jax.devices()[:1])
  lines = []
  for mode, adapters in (("full", None), ("lora", lora)):
    optimizer = make_optimizer(OptimizerConfig(), 100, weight_decay_mask(model) if adapters is None else None)
    shardings = state_shardings(model, optimizer, mesh, lora=adapters)
    shapes = jax.eval_shape(functools.partial(init_state, model, optimizer, 0, mesh, lora=adapters))
    abstract = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shardings, shapes)
    step = make_train_step(functools.partial(sft.loss, model=model), optimizer, mesh=mesh,
                           state_shardings=shardings, lora=adapters)
    rows = jax.ShapeDtypeStruct((batch, seq), np.int32, sharding=batch_sharding(mesh))
    data = {k: rows for k in ("tokens", "loss_mask", "segment_ids", "positions")}
    analysis = step.lower(abstract, data).compile().memory_analysis()
    lines.append({
        "bench": "lora_memory", "mode": mode, "rank": lora.rank if adapters else 0,
        "trained_params": sum(x.size for x in jax.tree.leaves(shapes.params)),
        "opt_state_bytes": _bytes(shapes.opt_state), "trained_bytes": _bytes(shapes.params),
        "frozen_base_bytes": _bytes(shapes.base) if shapes.base is not None else 0,
        "compiled_argument_bytes": analysis.argument_size_in_bytes,
        "compiled_output_bytes": analysis.output_size_in_bytes,
        "compiled_alias_bytes": analysis.alias_size_in_bytes,
        "compiled_temp_bytes": analysis.temp_size_in_bytes,
    })
  full, low = lines
  low["opt_state_ratio_vs_full"] = round(low["opt_state_bytes"] / full["opt_state_bytes"], 5)
  return lines


def _batches(digits: int, seed: int, n_batches: int, batch: int, seq: int):
  tokenizer = ByteTokenizer()
  task = ArithmeticTask(seed, digits, "+")
  for b in range(n_batches):
    rows = [task[b * batch + i] for i in range(batch)]
    yield pad_batch([sft_example(tokenizer, r["prompt"], r["answer"]) for r in rows], seq, tokenizer.pad_id)


def _train(model, base, lora, optim, data, steps):
  """Trains from `base` (fully, or adapters when `lora`) and returns the model parameters."""
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=1), jax.devices()[:1])
  optimizer = make_optimizer(optim, steps, weight_decay_mask(model) if lora is None else None)
  state = init_state(model, optimizer, 0, mesh, lora=lora, params=base)
  step = make_train_step(functools.partial(sft.loss, model=model), optimizer, mesh=mesh,
                         state_shardings=state_shardings(model, optimizer, mesh, lora=lora), lora=lora)
  for _, batch in zip(range(steps), data):
    state, metrics = step(state, batch)
  return jax.device_get(model_params(state, lora)), float(metrics["loss"])


def convergence(lora: LoRAConfig, steps: int, margin: float) -> dict:
  """Held-out loss on 3-digit addition after full fine-tuning and after LoRA, from a 2-digit base."""
  model = MODEL_PRESETS["tiny"]()
  batch, seq = 64, 16
  pretrain = OptimizerConfig(lr=3e-3, warmup_steps=20, weight_decay=0.01)
  base, _ = _train(model, jax.device_get(initial_params(model, 0)), None, pretrain,
                   _batches(2, 0, 10**6, batch, seq), 600)
  evaluate = jax.jit(lambda p, b: sft.loss(p, b, None, model=model)[1]["loss"])
  held_out = list(_batches(3, 1, 8, batch, seq))
  held_out_loss = lambda p: float(np.mean([evaluate(p, b) for b in held_out]))
  out = {"bench": "lora_convergence",
         "task": "tiny preset: base SFT on 2-digit addition, fine-tuned on 3-digit addition",
         "steps": steps, "batch": batch, "rank": lora.rank, "alpha": lora.alpha,
         "base_loss": held_out_loss(base)}
  runs = {"full": (None, OptimizerConfig(lr=3e-3, warmup_steps=20, weight_decay=0.01)),
          "lora": (lora, OptimizerConfig(lr=1e-2, warmup_steps=20))}
  for mode, (adapters, optim) in runs.items():
    params, train_loss = _train(model, base, adapters, optim, _batches(3, 0, 10**6, batch, seq), steps)
    out[f"{mode}_train_loss"] = train_loss
    out[f"{mode}_eval_loss"] = held_out_loss(params)
  out["margin"] = margin
  out["lora_within_margin"] = out["lora_eval_loss"] <= out["full_eval_loss"] + margin
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--part", choices=["memory", "convergence", "both"], default="both")
  parser.add_argument("--model", default="smollm2_135m", help="preset for the memory part")
  parser.add_argument("--rank", type=int, default=8)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=256)
  parser.add_argument("--steps", type=int, default=300, help="fine-tuning steps of the convergence part")
  parser.add_argument("--margin", type=float, default=0.05)
  args = parser.parse_args()
  lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank, targets=ALL_TARGETS)
  if args.part in ("memory", "both"):
    model = MODEL_PRESETS[args.model]()
    for line in memory(model, lora, args.batch, args.seq_len):
      print(json.dumps({"model": args.model, "params": count_params(model), **line}), flush=True)
  if args.part in ("convergence", "both"):
    print(json.dumps(convergence(lora, args.steps, args.margin)), flush=True)


if __name__ == "__main__":
  main()
