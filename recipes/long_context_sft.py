"""Long-context SFT: 128K-token sequences, sequence-parallel (ring attention over the `seq` mesh axis).

Launch (Llama-3.1-8B-Instruct at 128K tokens on a TPU v5p-64: 32 chips, 8
hosts; the same command on every host):

  python recipes/long_context_sft.py --preset llama3_8b_128k --distributed \
      --model-dir /ckpt/Llama-3.1-8B-Instruct \
      --data.train_files='["gs://bucket/long/train.jsonl"]' --data.eval_files='["gs://bucket/long/eval.jsonl"]' \
      --out gs://bucket/runs/long_context_sft

Topology: mesh fsdp=16 x seq=2. Parameters, gradients and Adam state are
sharded over `fsdp` (ZeRO-3); each 131072-token row is split over the two
`seq` chips, which run ring attention in the zig-zag layout (positions stay
global); every layer is rematerialised and the loss projects to the 128K
vocabulary 2048 tokens at a time, so no [T, V] logits exist. 16 rows x 128K =
2.1M tokens per step. Records are chat `messages` (only assistant turns
carry loss), packed first-fit into the 128K rows.

Expected memory per chip (estimate from `ptx.models.memory_floor`, not
measured on a TPU): floor 15 GiB = state 7.5 GiB (120 GiB of float32
parameters, gradients and Adam moments over 16 fsdp chips) + residual-stream
checkpoints 4 GiB + one layer's backward inputs 1.4 GiB + logits chunk 2 GiB;
XLA used 1.8x its floor in the CPU compile of the 1M-token test model, so
expect 20-30 GiB of a v5p's 95 GiB HBM.

Expected step time (estimate, not measured: no TPU was available): 6 x 8e9
params x 2.1M tokens = 1.0e17 FLOP plus causal attention 2.2e17 FLOP, at 40%
MFU of 32 x 459 TFLOP/s bf16: about 55 s/step (38k tokens/s).

Expected scores (estimate, not measured): eval/loss is data-dependent; a
long-context instruct model should keep its short-context loss (about
1.0-1.2 nats/token on chat data) while `ptx eval --task needle` accuracy
holds across depths.

Measured here (tiny preset, 2-core CPU, 8 fake devices on seq=8, byte
tokenizer): it runs two steps in the CI test (tests/recipes/
test_long_context_recipe.py) on synthetic needle chats written to OUT/data.
"""

from __future__ import annotations

import dataclasses

import launch
import ptx
from ptx.envs.needle import NeedleTask

_SEQ_PARALLEL = dict(attention_impl="ring", seq_layout="zigzag", remat="full")
PRESETS: launch.Presets = {
    "tiny": lambda: ptx.Config(
        model=dataclasses.replace(ptx.presets["tiny"](), logits_chunk=16, **_SEQ_PARALLEL),
        mesh=ptx.MeshConfig(data=1, fsdp=1, tensor=1, seq=8),
        optim=ptx.OptimizerConfig(lr=3e-3, warmup_steps=10, weight_decay=0.01),
        train=ptx.TrainConfig(steps=50, log_every=10, eval_every=25, checkpoint_every=25),
        data=ptx.DataConfig(batch_size=2, seq_len=512)),
    "llama3_8b_128k": lambda: ptx.Config(
        model=dataclasses.replace(ptx.presets["llama3_1_8b"](), logits_chunk=2048, **_SEQ_PARALLEL),
        mesh=ptx.MeshConfig(data=1, fsdp=16, tensor=1, seq=2),
        optim=ptx.OptimizerConfig(lr=5e-6, warmup_steps=50, weight_decay=0.0),
        train=ptx.TrainConfig(steps=1000, log_every=10, eval_every=100, checkpoint_every=100),
        data=ptx.DataConfig(batch_size=16, seq_len=131072)),
}


def synthetic_needles(split: str, n: int) -> list[dict]:
  """`n` needle-retrieval chats of 30-70 filler words, of one side of the split (the tiny preset's data)."""
  tasks = NeedleTask(lengths=(30, 50, 70), depths=(0.0, 0.5, 1.0), split=split)
  return [{"messages": [{"role": "user", "content": t["prompt"]}, {"role": "assistant", "content": t["answer"]}]}
          for t in (tasks[i] for i in range(n))]


def main(argv: list[str] | None = None) -> dict:
  """Runs the recipe; returns fit's summary."""
  return launch.run_supervised(__doc__, PRESETS, argv, synthetic_needles, 512, ptx.sft_job)


if __name__ == "__main__":
  main()
