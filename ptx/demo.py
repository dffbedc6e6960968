"""`ptx demo`: a tiny model learns 2-digit addition by SFT, then by GRPO, measured at each stage.

The built-in task needs nothing but ptx: seeded arithmetic problems, the byte
tokenizer and the tiny Llama-style preset. Stage 1 is SFT, the toy preset's
`sft_job` run by the same loop as `ptx sft` (checkpoints, metrics.jsonl,
TensorBoard) into OUT/sft; stage 2 continues from its parameters with the toy
GRPO preset's fused `grpo_job` (sampling, exact-match reward and updates in
one jitted step), the job `ptx grpo` runs, into OUT/grpo. Held-out
exact match is
measured with teacher forcing: a problem counts as solved when every answer
token and the end-of-sequence token are the model's argmax given the correct
prefix, which is exactly when greedy decoding reproduces the answer.

Both training streams draw from the train side of the task's split and the
held-out problems from the other side (`ptx.data.splits`); the summary
(printed, and OUT/summary.json) counts the held-out problems the SFT records
and the GRPO prompts read share with them, which is 0.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ptx.algorithms import sft
from ptx.config import Config, DataConfig
from ptx.model_config import ModelConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.batch import pad_batch, sft_example
from ptx.data.global_batch import to_global
from ptx.data.pipeline import make_pipeline
from ptx.data.sources import MemorySource
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import forward
from ptx.episodes import evaluation
from ptx.envs.exact_answer import ExactAnswerEnv
from ptx.sampling.text import TextSampler
from ptx.sharding import make_mesh
from ptx.train import plots, presets, run_dir, streams
from ptx.train.export import export_hf
from ptx.train.job import grpo_job, sft_job
from ptx.train.loop import fit
from ptx.train.state import initial_params

EVAL_SIZE = 512
SFT_TASKS = ArithmeticTask(presets.SFT_SEED, presets.DIGITS)
GRPO_TASKS = ArithmeticTask(presets.GRPO_SEED, presets.DIGITS)
HELD_OUT_TASKS = ArithmeticTask(presets.HELD_OUT_SEED, presets.DIGITS, split="held_out")
# Sampled pass@k (temperature 1) is measured on the first held-out problems.
SAMPLED_TASKS, K = 256, 8


def default_config() -> Config:
  """The demo's configuration: the toy SFT preset on 64 unpacked problems a step; its `grpo` is the GRPO stage's."""
  return dataclasses.replace(presets.TOY["sft"](), data=DataConfig(batch_size=64, seq_len=16, pack=False))


def grpo_config(cfg: Config, rl_steps: int) -> Config:
  """The GRPO stage's config: the toy GRPO preset with the demo's model, mesh, LoRA and GRPO sections."""
  rl = presets.TOY["grpo"]()
  steps = max(rl_steps, 1)
  train = dataclasses.replace(rl.train, steps=rl_steps, seed=cfg.train.seed, checkpoint_every=steps, eval_every=steps)
  return dataclasses.replace(rl, model=cfg.model, mesh=cfg.mesh, lora=cfg.lora, grpo=cfg.grpo, train=train)


def records(tasks: ArithmeticTask, n: int) -> list[dict[str, str]]:
  """The first `n` problems of `tasks` as SFT records."""
  return [{"prompt": r["prompt"], "completion": r["answer"]} for r in (tasks[i] for i in range(n))]


@dataclasses.dataclass(frozen=True)
class ReadPrompts:
  """A task source that keeps the prompts read from it: the problems a GRPO stream trained on."""

  tasks: ArithmeticTask
  read: set[str] = dataclasses.field(default_factory=set)

  def __getitem__(self, index: int) -> dict[str, str]:
    task = self.tasks[index]
    self.read.add(task["prompt"])
    return task


def overlap(held_out: list[dict[str, str]], trained: dict[str, set[str]]) -> dict:
  """The held-out problems' distinct count, the split's sizes, and how many each training stream shares."""
  prompts = {r["prompt"] for r in held_out}
  return {"problems": len(prompts), "split_sizes": HELD_OUT_TASKS.split_sizes(),
          "shared_with": {stage: len(prompts & seen) for stage, seen in trained.items()}}


def exact_match(params, batch, *, model) -> jax.Array:
  """Fraction of rows whose every target token is the argmax (= greedy decoding is correct)."""
  logits = forward(params, batch["tokens"], model, positions=batch["positions"],
                   segment_ids=batch["segment_ids"])[:, :-1]
  targets, weights = sft.next_token_targets(batch)
  wrong = (jnp.argmax(logits, axis=-1) != targets) & (weights > 0)
  return jnp.mean(~jnp.any(wrong, axis=-1))


_greedy = jax.jit(exact_match, static_argnames="model")


def held_out_rows(cfg: Config) -> dict[str, jax.Array]:
  """The first EVAL_SIZE held-out problems as SFT rows of `cfg.data.seq_len` tokens (host arrays)."""
  tokenizer = ByteTokenizer()
  rows = [sft_example(tokenizer, r["prompt"], r["completion"]) for r in records(HELD_OUT_TASKS, EVAL_SIZE)]
  return pad_batch(rows, cfg.data.seq_len, tokenizer.pad_id)


def held_out_scores(params, model: ModelConfig, mesh: Mesh, eval_batch: dict[str, jax.Array]) -> dict[str, float]:
  """Greedy exact match on `eval_batch` (the held-out SFT rows), and pass@1 and pass@K sampled at temperature 1."""
  sampler = TextSampler(params, model, ByteTokenizer(), max_new_tokens=presets.ANSWER_WIDTH,
                        seed=presets.HELD_OUT_SEED, mesh=mesh)
  report = evaluation.evaluate(sampler, ExactAnswerEnv(), [HELD_OUT_TASKS[i] for i in range(SAMPLED_TASKS)], k=K)
  return {"greedy": float(_greedy(params, eval_batch, model=model)), "pass@1": report["pass@k"]["1"],
          f"pass@{K}": report["pass@k"][str(K)]}


def run(cfg: Config, out: pathlib.Path, *, rl_steps: int = 400, resume: bool = False, overwrite: bool = False,
        progress: bool = True) -> dict:
  """Trains (SFT, then `rl_steps` of GRPO) and evaluates the demo; returns the summary (also printed as JSON).

  `resume` continues the runs in OUT/sft and OUT/grpo, `overwrite` replaces
  them; without either an earlier demo in `out` is refused
  (`ptx.train.run_dir.check`).
  """
  for stage in ("sft", "grpo"):  # before the minutes of the first evaluation; fit replaces them
    run_dir.agreed(functools.partial(run_dir.check, out / stage, resume=resume, overwrite=overwrite))
  tokenizer = ByteTokenizer()
  rl_cfg = grpo_config(cfg, rl_steps)
  sft_stage, grpo_stage = sft_job(cfg, tokenizer), grpo_job(rl_cfg, tokenizer)  # both checked before compiling
  sft_records = records(SFT_TASKS, cfg.train.steps * cfg.data.batch_size)
  held_out_records = records(HELD_OUT_TASKS, EVAL_SIZE)
  train = make_pipeline(MemorySource(sft_records, "arithmetic"), tokenizer, cfg.data)
  mesh = make_mesh(cfg.mesh)
  held_out_batch = held_out_rows(cfg)
  eval_batch = to_global(held_out_batch, mesh)
  evaluate = functools.partial(held_out_scores, model=cfg.model, mesh=mesh, eval_batch=eval_batch)

  before = evaluate(initial_params(cfg.model, cfg.train.seed))
  state, sft_summary = fit(cfg, sft_stage, train_data=train, out=out / "sft", resume=resume,
                           overwrite=overwrite, eval_data=[held_out_batch], progress=progress)
  after_sft = evaluate(state.params)
  grpo_tasks = ReadPrompts(GRPO_TASKS)
  prompts = streams.grpo_prompts(rl_cfg, tokenizer, grpo_tasks, in_graph=True)
  state, rl_summary = fit(rl_cfg, grpo_stage, train_data=prompts, out=out / "grpo", init_params=state.params,
                          resume=resume, overwrite=overwrite, progress=progress)
  after_rl = evaluate(state.params)
  exported = export_hf(state, cfg, out, tokenizer)
  stages = {"initial model": before, f"SFT ({sft_summary['step']} steps)": after_sft,
            f"+ GRPO ({rl_summary['step']} steps)": after_rl}
  summary = {"init": before, "sft": after_sft, "grpo": after_rl, "sft_steps": sft_summary["step"],
             "grpo_steps": rl_summary["step"], "train_s": sft_summary["wall_s"] + rl_summary["wall_s"],
             "hf": str(exported["hf"]), "plots": [str(p) for p in write_plots(out, stages)],
             "held_out": overlap(held_out_records, {"sft": {r["prompt"] for r in sft_records},
                                                    "grpo": grpo_tasks.read})}
  print_table(summary, stages)
  print(json.dumps({"demo": summary}))
  (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
  return summary


def print_table(summary: dict, stages: dict[str, dict[str, float]]) -> None:
  """Prints what was held out and the stages' held-out scores."""
  held = summary["held_out"]
  print(f"\nheld-out {presets.DIGITS}-digit addition: greedy exact match on {EVAL_SIZE} draws "
        f"({held['problems']} distinct problems) from the held-out side of the split "
        f"({held['split_sizes']['held_out']} problems; the train side has {held['split_sizes']['train']}), "
        f"pass@1 and pass@{K} sampled at temperature 1 on the first {SAMPLED_TASKS}; "
        f"of them the SFT records hold {held['shared_with']['sft']}, the GRPO prompts {held['shared_with']['grpo']}")
  print(f"  {'stage':<22}{'greedy':>8}{'pass@1':>9}{f'pass@{K}':>9}")
  for name, row in stages.items():
    print(f"  {name:<22}{row['greedy']:>8.1%}{row['pass@1']:>9.1%}{row[f'pass@{K}']:>9.1%}")


def write_plots(out: pathlib.Path, stages: dict[str, dict[str, float]]) -> list[pathlib.Path]:
  """OUT/plots/: SFT loss, GRPO reward and response length over steps, and accuracy per stage."""
  sft_records = plots.read_metrics(out / "sft" / "metrics.jsonl")
  rl_records = plots.read_metrics(out / "grpo" / "metrics.jsonl")
  written = [plots.plot_curves(sft_records, {"loss": "train loss", "eval/loss": "held-out loss"},
                               out / "plots" / "sft_loss.png", title="SFT on 2-digit addition",
                               ylabel="cross-entropy (nats / answer token)")]
  if any("reward/mean" in record for record in rl_records):  # --rl-steps 0 logs no GRPO step
    written += [
        plots.plot_curves(rl_records, {"reward/mean": "mean exact-match reward of the rollouts"},
                          out / "plots" / "grpo_reward.png", title="GRPO: reward over steps",
                          ylabel="reward (fraction of samples correct)"),
        plots.plot_curves(rl_records, {"response_length/mean": "mean", "response_length/max": "max"},
                          out / "plots" / "grpo_response_length.png", title="GRPO: response length over steps",
                          ylabel="response length (tokens, incl. eos)"),
    ]
  return written + [plots.plot_stages(stages, out / "plots" / "accuracy.png",
                                      title=f"Held-out {presets.DIGITS}-digit addition before and after each stage")]
