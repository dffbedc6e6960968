"""SFT on chat data: JSONL records {"messages": [{"role", "content"}, ...]}, trained on the assistant turns.

Launch (Llama-3.1-8B-Instruct on a TPU v5p-32: 16 chips, 4 hosts; the same
command on every host):

  python recipes/sft_chat.py --preset llama3_8b --distributed --model-dir /ckpt/Llama-3.1-8B-Instruct \
      --data.train_files='["gs://bucket/chat/train.jsonl"]' --data.eval_files='["gs://bucket/chat/eval.jsonl"]' \
      --out gs://bucket/runs/sft_chat

Topology: one mesh, all 16 chips on `fsdp` (parameters, gradients and Adam
state sharded ZeRO-3 style), bfloat16, full remat; 64 rows x 4096 packed
tokens per step. The chat template is the model's own (tokenizer_config.json);
only assistant turns carry loss.

Expected step time (estimate, not measured: no TPU was available):
6 x 8.0e9 params x 262k tokens = 1.3e16 FLOP per step at 40% MFU of 16 x 459
TFLOP/s bf16 is about 4.3 s/step (61k tokens/s). Expected scores: eval/loss
is data-dependent; on UltraChat-style data an 8B instruct model starts near
1.2 nats/token and an epoch brings it to about 1.0 (published-range estimate,
not measured here).

Launch (Qwen3-235B-A22B, a Mixture of Experts, on a TPU v5p-128: 64 chips, 16
hosts; the same command on every host):

  python recipes/sft_chat.py --preset qwen3_235b_a22b --distributed --model-dir /ckpt/Qwen3-235B-A22B \
      --data.train_files='["gs://bucket/chat/train.jsonl"]' --data.eval_files='["gs://bucket/chat/eval.jsonl"]' \
      --out gs://bucket/runs/sft_chat_235b

Topology: `fsdp` 8 x `expert` 8: each chip holds 16 of the 128 experts of
every layer (their d_model split over the 8 chips of its fsdp group) and 1/64
of every other weight; a token's 8 expert copies go to their experts' chips by
all-to-all (`model.moe_impl` "auto" is expert_parallel on this mesh), at most
512 from a chip to an expert (`model.moe_capacity_factor=2.0`: the copies past
a busy expert's capacity are dropped, their fraction logged as
`moe/tokens_dropped`, their tokens' predictions left out of the loss);
bfloat16, full remat; 64 rows x 4096 packed tokens per step, one row per chip.
Memory (measured on CPU: `python benchmarks/pod_fit.py --recipe sft_chat
--preset qwen3_235b_a22b`, 64 chips faked): 55.7 GiB per chip of 95, the state
20.5 exact (bfloat16 parameters and Adam moments, 1.28 TiB in all) and the
step's scratch 35.1 (XLA:CPU's, typically high for bfloat16:
`ptx.train.pod_fit`). Why 64 chips and the capacity: on a v5p-64 (state 41.1)
it is 109.6; dropless (`--model.moe_capacity_factor=None`) it is 95.6, over by
0.6, its all-to-all buffers holding 128 experts x 4096 slots of d_model.

Expected step time (estimate, not measured): at capacity 2.0 the experts
compute twice the active experts' work, 6 x (8.0e9 + 2 x 14.2e9) params x
262k tokens = 5.7e16 FLOP per step, 4.9 s at 40% MFU of 64 x 459 TFLOP/s,
plus the all-to-alls (0.5 GiB per chip each, 6 per layer: 282 GiB a step);
dropless, every expert would run on every token (3.7e17 FLOP, 31 s).
Expected scores: as the 8B's, eval/loss is data-dependent.

Launch (Kimi K2, 1.03T parameters, multi-head latent attention and 384
experts, on a TPU v5p-1024: 512 chips, 128 hosts; the same command on every
host; its FP8 hub weights load dequantised):

  python recipes/sft_chat.py --preset kimi_k2 --distributed --model-dir /ckpt/Kimi-K2-Instruct \
      --data.train_files='["gs://bucket/chat/train.jsonl"]' --data.eval_files='["gs://bucket/chat/eval.jsonl"]' \
      --out gs://bucket/runs/sft_chat_k2

Topology: `fsdp` 8 x `expert` 64: each chip holds 6 of the 384 experts of
every layer (their d_model split over its fsdp group of 8) and 1/512 of every
other weight; experts' capacity 2.0 as above; bfloat16, full remat; 512 rows x
4096 packed tokens per step, one row per chip. Memory (measured on CPU:
`python benchmarks/pod_fit.py --recipe sft_chat --preset kimi_k2`, 512 chips
faked, compiled in 25-33 s): 47.8 GiB per chip of 95, the state 11.2 exact
(parameters 3.7, Adam 7.5) and the step's scratch 36.6 (XLA:CPU's).

Expected step time (estimate, not measured): 32.9e9 active parameters, of
which 21.1e9 routed experts' run twice at capacity 2.0: 6 x 54e9 x 2.1M tokens
= 6.8e17 FLOP per step, 7.2 s at 40% MFU of 512 x 459 TFLOP/s, plus the
all-to-alls. Sampling (GRPO) of an MLA model is not built yet.

Measured here (tiny preset, 2-core CPU, 8 fake devices, byte tokenizer): see
recipes/README.md for the step time and the loss it reaches on the synthetic
chats it writes to OUT/data.
"""

from __future__ import annotations

import dataclasses

import launch
import ptx

PRESETS: launch.Presets = {
    "tiny": lambda: ptx.Config(
        model=ptx.presets["tiny"](),
        optim=ptx.OptimizerConfig(lr=3e-3, warmup_steps=10, weight_decay=0.01),
        train=ptx.TrainConfig(steps=100, log_every=10, eval_every=50, checkpoint_every=50),
        data=ptx.DataConfig(batch_size=16, seq_len=128)),
    # A small instruct model (SmolLM2-135M/360M, Qwen2.5-0.5B) on a laptop or a Colab runtime.
    "small": lambda: dataclasses.replace(ptx.FINETUNE["sft"](), data=ptx.DataConfig(batch_size=8, seq_len=1024)),
    "llama3_8b": lambda: _pod("llama3_1_8b", ptx.MeshConfig(), batch_size=64),
    # Experts over the 8 chips of `expert`, at most twice a balanced load of copies per expert (header: why).
    "qwen3_235b_a22b": lambda: _pod("qwen3_235b_a22b", ptx.MeshConfig(expert=8), batch_size=64,
                                    moe_capacity_factor=2.0),
    # 6 of the 384 experts per chip over the 64 of `expert`, the capacity as the 235B's (header: memory).
    "kimi_k2": lambda: _pod("kimi_k2", ptx.MeshConfig(expert=64), batch_size=512, moe_capacity_factor=2.0),
}


def _pod(model: str, mesh: ptx.MeshConfig, *, batch_size: int, **model_fields) -> ptx.Config:
  """A pod preset: `model` fully rematerialised with `model_fields`, 4,096-token rows, 2,000 steps at lr 1e-5."""
  return ptx.Config(
      model=dataclasses.replace(ptx.presets[model](), remat="full", **model_fields), mesh=mesh,
      optim=ptx.OptimizerConfig(lr=1e-5, warmup_steps=100, weight_decay=0.0),
      train=ptx.TrainConfig(steps=2000, log_every=10, eval_every=200, checkpoint_every=200),
      data=ptx.DataConfig(batch_size=batch_size, seq_len=4096))


def synthetic_chats(split: str, n: int) -> list[dict]:
  """`n` short arithmetic conversations of one side of the split, in the `messages` format (the tiny preset's data)."""
  tasks = ptx.ArithmeticTask(max_digits=2, ops="+-", split=split)
  return [{"messages": [{"role": "user", "content": f"What is {t['prompt'][:-1]}?"},
                        {"role": "assistant", "content": f"{t['prompt'][:-1]} = {t['answer']}."}]}
          for t in (tasks[i] for i in range(n))]


def main(argv: list[str] | None = None) -> dict:
  """Runs the recipe; returns fit's summary."""
  return launch.run_supervised(__doc__, PRESETS, argv, synthetic_chats, 4000, ptx.sft_job)


if __name__ == "__main__":
  main()
