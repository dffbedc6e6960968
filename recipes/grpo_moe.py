"""GRPO of a Mixture of Experts (Qwen3-30B-A3B, Kimi K2, gpt-oss-20b) on GSM8K-format math, with routing replay.

The data, prompts and verifier are `grpo_math.py`'s: JSONL records {"question",
"answer": "...#### 72"}, each solution scored on the host by the math verifier
while the device samples the next batch (GRPO host-reward mode). What this
recipe adds is the model and routing replay (`grpo.routing_replay=rollout`):
the sampler records which experts every MoE layer chose for every token, on the
device, and the update's forwards use those experts (their gate weights from the
live router), so the policy the update scores is the one that sampled. Without
replay, a router near a tie picks other experts in the update than in the
sampler; the published evidence is that GRPO of Qwen3-30B-A3B then collapses
(3 of 3 baseline runs, NVIDIA/Megatron-LM #4168, quoting arXiv 2510.11370).
The update logs `moe/route_flips` (the replayed experts its own router would
not pick) and the load of each layer's experts (`moe/layerNN/...`).

Launch (Qwen3-30B-A3B on a TPU v5p-64: 32 chips, 8 hosts; the same command on
every host):

  python recipes/grpo_moe.py --preset qwen3_30b_a3b --distributed --model-dir /ckpt/Qwen3-30B-A3B \
      --data.train_files='["gs://bucket/gsm8k/train.jsonl"]' --data.eval_files='["gs://bucket/gsm8k/test.jsonl"]' \
      --out gs://bucket/runs/grpo_moe

Topology: `fsdp` 4 x `expert` 8 (`mesh.expert=8` in the preset): each chip holds
16 of the 128 experts of every layer, their d_model split over the 4 chips of
its fsdp group, and 1/32 of every other weight; a token's 8 expert copies go
to their experts' chips and back by all-to-all (`model.moe_impl` "auto" is
expert_parallel on this mesh, in the update and in the sampler alike). The
update's experts take at most `model.moe_capacity_factor` 2.0 times a balanced
load (1,536 of a chip's 12,288 tokens each): copies past a busy expert's
capacity are dropped, counted (`moe/tokens_dropped`), and the predictions of
their tokens leave the loss; the sampler never drops. Dropless (the factor
None) fits too, but runs every expert on every slot, filled or not: 8 times
the update's work at 2.0. bfloat16, full remat; 64 prompts x 8 samples per
step, 512 new tokens; the frozen reference (beta 0.04) is a second sharded copy
and routes itself. The load-balancing and z-losses stay off
(`model.moe_balance_coef`, `model.moe_z_coef`: NeMo-RL measured the balancing
loss degrading RL accuracy); watch `moe/tokens_dropped`, and raise the factor
if it climbs.

Memory (measured on CPU: `python benchmarks/pod_fit.py --recipe grpo_moe
--preset qwen3_30b_a3b`, 32 chips faked): 44.2 GiB per chip of 95: the state
7.1 GiB, exact (parameters 1.8, Adam 3.6, reference 1.8), the sampler's
scratch 37.0 (each layer's 16 local experts gathered over fsdp once per
rollout, not per decode step) and the update's 22.9. Dropless, the update's
scratch is 83.3 (its all-to-all buffers hold 128 experts x 12,288 slots of
d_model): 90.4 in all. XLA:CPU's figures, typically high for bfloat16
(`ptx.train.pod_fit`); a TPU compile is still to confirm them.

Expected step time (estimate, not measured: no TPU was available): the update
runs twice the active experts' work at capacity 2.0: 6 x 3.35e9 active params
x 512 rows x 768 tokens = 7.9e15 FLOP, about 2 s at 40% MFU of 32 x 459
TFLOP/s with the doubled expert share (dropless: 7.2e16, 12 s); decoding 512
tokens for 512 rows reads, at each step, a chip's 16 experts (7.2 GB of
bfloat16) and the 3.1 GB of other weights (3.7 ms at 2.8 TB/s) plus the KV
cache: about 2 s for the 512 steps. With the reference's forward, about 6 s
per step. Expected scores (published figures, not measured): the Qwen3
technical report gives GSM8K in the low 90s for Qwen3-30B-A3B; GRPO on the
train split holds or raises greedy pass@1 by a point or two.

Kimi K2 (1.04T parameters, 32.6B active) on a TPU v5p-1024 (512 chips, 128
hosts), the same command with `--preset kimi_k2 --model-dir /ckpt/Kimi-K2-Instruct`:
`expert` 64 x `tensor` 8 (fsdp 1): each chip holds 6 of the 384 experts of every
layer with their hidden width split 8 ways, 8 of the 64 MLA heads, and 1/512 of
every other weight; 64 prompts x 8 samples, 512 new tokens, capacity 2.0 in the
update, routing replay. The sampler decodes over the latent KV cache (one
576-wide latent a token and layer) in the absorbed form. Memory (measured on
CPU: `python benchmarks/pod_fit.py --recipe grpo_moe --preset kimi_k2`, 512
chips faked, 390 s to compile, 4.5 GiB of host memory): 54.1 GiB per chip of
95: the state 15.0 (parameters 3.8, Adam 7.5, reference 3.8), the sampler's
scratch 37.7 and the update's 39.1. SFT's layout (fsdp 8 x expert 64,
`sft_chat.py --preset kimi_k2`) does not serve GRPO: its sampler gathers every
layer's weights over fsdp once per rollout, 200 GiB of scratch (215 in all).
Expected step time (estimate, not measured): the update and the reference's
forward at capacity 2.0 run about 2.1e17 FLOP (routed experts counted twice,
full remat), 2.2 s at 40% MFU of 512 x 459 TFLOP/s; each decode step reads
about 7 GB a chip (its experts' slices and 1/8 of the other weights, 2.5 ms
at 2.8 TB/s) and waits on 61 layers' all-to-alls and tensor all-reduces: about
4 s for the 512 steps, 7-8 s a step in all.

gpt-oss-20b (20.9B parameters, 3.6B active: attention sinks, clamped SwiGLU,
biased experts; MXFP4 hub weights dequantised on load) on one host, a
TPU v5p-8 (4 chips), the same command with `--preset gpt_oss_20b --model-dir
/ckpt/gpt-oss-20b` (no --distributed): `expert` 4, each chip 8 of the 32
experts and 1/4 of every other weight; 16 prompts x 8 samples, 512 new
tokens, the update in 4 micro-batches (`train.grad_accum`), capacity 2.0, and
no reference (beta 0, as DAPO and Dr. GRPO run; a frozen copy would not fit
beside Adam on 4 chips). Memory (measured on CPU: `python
benchmarks/pod_fit.py --recipe grpo_moe --preset gpt_oss_20b`, 4 chips faked,
93 s to compile): 90.2 GiB per chip of 95: the state 29.2 (parameters 9.7,
Adam 19.5), the sampler's scratch 47.3 and the update's 61.0; with the
reference (beta 0.04) 109.2. Expected step time (estimate, not measured): the
update's 5.2e15 FLOP (routed experts twice, full remat) take about 7 s at 40%
MFU of 4 x 459 TFLOP/s; each decode step reads about 12 GB a chip (its 8
experts, attention and the output layer: 4.3 ms at 2.8 TB/s), about 4 s for
the 512 steps: 11-12 s a step.

Measured here (tiny preset, 2-core CPU): the pipeline only: a random byte-level
MoE (8 experts of 192, 2 per token: the tiny model's active width) on
synthetic word problems scores 0 before and after; step time in
recipes/README.md.
"""

from __future__ import annotations

import dataclasses

import grpo_math
import launch
import ptx
import rlvr

REPLAY = {"routing_replay": "rollout"}


def _tiny() -> ptx.Config:
  """`grpo_math`'s tiny preset with the tiny model's MLP as 8 experts of 192, 2 per token, and routing replay."""
  cfg = rlvr.tiny(prompt_len=192)
  moe = ptx.MoeConfig(n_experts=8, experts_per_token=2, expert_mlp_dim=192)
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe),
                             grpo=dataclasses.replace(cfg.grpo, **REPLAY))


def _qwen3_30b_a3b() -> ptx.Config:
  """Qwen3-30B-A3B (weights from --model-dir): `grpo_math`'s pod preset, routing replay, 8-way experts at capacity 2."""
  cfg = rlvr.qwen7b(dataclasses.replace(ptx.GRPO_PRESETS["grpo_paper"], group_size=8, max_response_tokens=512,
                                        **REPLAY), steps=300, prompts=64, prompt_len=256)
  model = dataclasses.replace(ptx.presets["qwen3_30b_a3b"](), remat="full", moe_capacity_factor=2.0)
  return dataclasses.replace(cfg, model=model, mesh=ptx.MeshConfig(expert=8))


def _kimi_k2() -> ptx.Config:
  """Kimi K2 (weights from --model-dir): the 30B's preset, experts 64 ways and heads and expert widths 8 ways."""
  cfg = _qwen3_30b_a3b()
  model = dataclasses.replace(ptx.presets["kimi_k2"](), remat="full", moe_capacity_factor=2.0)
  return dataclasses.replace(cfg, model=model, mesh=ptx.MeshConfig(fsdp=1, expert=64, tensor=8))


def _gpt_oss_20b() -> ptx.Config:
  """gpt-oss-20b (weights from --model-dir): the 30B's preset on one host: 32 experts 4 ways, 16 prompts x 8 in 4
  micro-batches."""
  cfg = _qwen3_30b_a3b()
  model = dataclasses.replace(ptx.presets["gpt_oss_20b"](), remat="full", moe_capacity_factor=2.0)
  return dataclasses.replace(cfg, model=model, mesh=ptx.MeshConfig(fsdp=1, expert=4),
                             data=dataclasses.replace(cfg.data, batch_size=16),
                             train=dataclasses.replace(cfg.train, grad_accum=4),
                             grpo=dataclasses.replace(cfg.grpo, beta=0.0))


PRESETS: launch.Presets = {"tiny": _tiny, "qwen3_30b_a3b": _qwen3_30b_a3b, "kimi_k2": _kimi_k2,
                           "gpt_oss_20b": _gpt_oss_20b}


def main(argv: list[str] | None = None) -> dict:
  """Runs the recipe; returns fit's summary with greedy pass@1 before and after."""
  return grpo_math.main(argv, doc=__doc__, presets=PRESETS)


if __name__ == "__main__":
  main()
