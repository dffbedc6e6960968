"""DPO on preference JSONL: records {"prompt", "chosen", "rejected"} (prompt: a string or chat messages).

Launch (from an SFT'd Llama-3.1-8B on a TPU v5p-32: 16 chips, 4 hosts; the
same command on every host):

  python recipes/dpo.py --preset llama3_8b --distributed --model-dir /ckpt/llama3-8b-sft \
      --data.train_files='["gs://bucket/prefs/train.jsonl"]' --data.eval_files='["gs://bucket/prefs/eval.jsonl"]' \
      --out gs://bucket/runs/dpo

Topology: all 16 chips on `fsdp`; the frozen reference is a second sharded
copy of the starting weights (the reference log-probs are computed in the
same jitted step, no second model server); bfloat16, full remat; 64 pairs
of 2 x 2048 tokens per step. Variants: --dpo.loss_type=ipo|hinge|simpo,
--dpo.label_smoothing=0.1 (cDPO); --lora.rank=16 trains adapters and uses
the base as the reference (no copy).

Expected step time (estimate, not measured: no TPU was available): policy
forward+backward plus reference forward is 8 x 8.0e9 params x 262k tokens =
1.7e16 FLOP per step; at 40% MFU of 16 x 459 TFLOP/s bf16 about 5.7 s/step.
Expected scores (published-range estimate for UltraFeedback-style data, not
measured): rewards/accuracies 0.7-0.8 on held-out pairs after one epoch at
beta 0.1.

Measured here (tiny preset, 2-core CPU): the step time and the held-out
rewards/accuracies it reaches on its synthetic pairs (a sum chosen over a
refusal) are in recipes/README.md.
"""

from __future__ import annotations

import dataclasses

import launch
import ptx

PRESETS: launch.Presets = {
    "tiny": lambda: ptx.Config(
        model=ptx.presets["tiny"](),
        optim=ptx.OptimizerConfig(lr=1e-3, warmup_steps=5),
        train=ptx.TrainConfig(steps=60, log_every=10, eval_every=30, checkpoint_every=30),
        data=ptx.DataConfig(kind="preference", batch_size=16, seq_len=16, pack=False),
        dpo=ptx.DPOConfig(beta=0.1)),
    # A small SFT'd model (SmolLM2-135M/360M, Qwen2.5-0.5B) on a laptop or a Colab runtime.
    "small": lambda: dataclasses.replace(
        ptx.FINETUNE["dpo"](), data=ptx.DataConfig(kind="preference", batch_size=8, seq_len=512, pack=False)),
    "llama3_8b": lambda: ptx.Config(
        model=dataclasses.replace(ptx.presets["llama3_1_8b"](), remat="full"),
        optim=ptx.OptimizerConfig(lr=5e-7, warmup_steps=50, weight_decay=0.0),
        train=ptx.TrainConfig(steps=1000, log_every=10, eval_every=100, checkpoint_every=100),
        data=ptx.DataConfig(kind="preference", batch_size=64, seq_len=2048, pack=False),
        dpo=ptx.DPOConfig(beta=0.1)),
}


def synthetic_pairs(split: str, n: int) -> list[dict]:
  """`n` pairs "a+b=" of one side of the split: the sum chosen over a refusal (the tiny preset's data)."""
  tasks = ptx.ArithmeticTask(max_digits=2, split=split)
  return [{"prompt": t["prompt"], "chosen": t["answer"], "rejected": "I cannot say."}
          for t in (tasks[i] for i in range(n))]


def main(argv: list[str] | None = None) -> dict:
  """Runs the recipe; returns fit's summary."""
  return launch.run_supervised(__doc__, PRESETS, argv, synthetic_pairs, 2000, ptx.dpo_job)


if __name__ == "__main__":
  main()
