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
import functools

import jax

import launch
import ptx
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.pipeline import make_pipeline
from ptx.data.sources import JsonlSource
from ptx.train.export import export_hf
from ptx.train.loop import fit

PRESETS: launch.Presets = {
    "tiny": lambda: ptx.Config(
        model=ptx.presets["tiny"](),
        optim=ptx.OptimizerConfig(lr=1e-3, warmup_steps=5),
        train=ptx.TrainConfig(steps=60, log_every=10, eval_every=30, checkpoint_every=30),
        data=ptx.DataConfig(batch_size=16, seq_len=16, pack=False),
        dpo=ptx.DPOConfig(beta=0.1)),
    "llama3_8b": lambda: ptx.Config(
        model=dataclasses.replace(ptx.presets["llama3_1_8b"](), remat="full"),
        optim=ptx.OptimizerConfig(lr=5e-7, warmup_steps=50, weight_decay=0.0),
        train=ptx.TrainConfig(steps=1000, log_every=10, eval_every=100, checkpoint_every=100),
        data=ptx.DataConfig(batch_size=64, seq_len=2048, pack=False),
        dpo=ptx.DPOConfig(beta=0.1)),
}


def synthetic_pairs(seed: int, n: int) -> list[dict]:
  """`n` pairs "a+b=": the sum chosen over a refusal (the tiny preset's data)."""
  tasks = ArithmeticTask(seed, max_digits=2)
  return [{"prompt": t["prompt"], "chosen": t["answer"], "rejected": "I cannot say."} for t in (tasks[i] for i in range(n))]


def main(argv: list[str] | None = None) -> dict:
  """Runs the recipe; returns fit's summary."""
  args, cfg, params, tokenizer = launch.data_recipe(__doc__, PRESETS, argv, synthetic_pairs, 2000)
  data_cfg = dataclasses.replace(cfg.data, kind="preference", pack=False)
  pipeline = functools.partial(make_pipeline, tokenizer=tokenizer, process_index=jax.process_index(),
                               process_count=jax.process_count())
  evaluation = None
  if data_cfg.eval_files:
    evaluation = list(pipeline(JsonlSource(data_cfg.eval_files),
                               cfg=dataclasses.replace(data_cfg, shuffle=False, num_epochs=1)))
  reference_free = cfg.dpo.loss_type == "simpo"
  state, summary = fit(
      cfg, loss_fn=functools.partial(ptx.dpo.loss, model=cfg.model, dpo=cfg.dpo),
      train_data=pipeline(JsonlSource(data_cfg.train_files), cfg=data_cfg), out=args.out, resume=args.resume,
      eval_data=evaluation, prepare=None if reference_free else functools.partial(ptx.dpo.prepare, model=cfg.model),
      init_params=params, progress=launch.progress(args))
  export_hf(state, cfg, args.out, tokenizer, base_model=None if args.model_dir is None else str(args.model_dir))
  return summary


if __name__ == "__main__":
  main()
