"""Every `ptx grpo --env` trains from the command line (#61): from a checkpoint (`--model-dir`) in each of the five
environments (terminal and the episode environments on their built-in tasks), and from a fresh model in the one no
other command-line test trains, code. The fresh-model runs of exact_answer, calculator and docqa are in
tests/test_cli_grpo.py, of terminal records in test_grpo_terminal_on_ray.py (its `--executor=local` run).

Runs of one step kind and shape share their compiled programs within a worker, so the checkpoint runs of code and of
terminal cost little beside those of exact_answer and calculator.
"""

import math

import pytest

from cli_runs import by_step, files_flag, write_jsonl
from ptx import cli

pytest.importorskip("tokenizers", reason="a checkpoint's tokenizer needs the hf extra (`make test` installs it)")

# One step of 8 tasks x 2 samples over the (data=2, fsdp=4) batch axes; the entropy bonus and the KL term give
# gradients while a random model earns no reward. Episodes sample on-policy (the only way they train) and take short
# turns; every first prompt of the built-in episode tasks fits 1,088 byte tokens.
SHAPE = ["--no-progress", "--no-export", "--train.steps=1", "--train.log_every=1", "--data.batch_size=8",
         "--grpo.group_size=2", "--grpo.entropy_coef=0.05", "--grpo.beta=0.04", "--grpo.kl_placement=loss",
         "--mesh.data=2", "--mesh.fsdp=4"]
EPISODES = ["--grpo.max_staleness=0", "--grpo.turn_tokens=8", "--grpo.max_response_tokens=160",
            "--data.seq_len=1088"]
# Records of the single-turn environments, chat-format prompts for exact_answer (an instruct model's own format).
RECORDS = {
    "exact_answer": [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)}
                     for i in range(8)],
    "code": [{"prompt": f"Write add(a, b) returning a + b + {i}.", "tests": [f"assert add(1, 2) == {3 + i}"]}
             for i in range(8)],
}


def _train(tmp_path, env, *start):
  """Step 1's metrics of `ptx grpo --env ENV` on RECORDS[env] (or the built-in tasks) from `start`."""
  out = tmp_path / "run"
  if env in RECORDS:
    data = [files_flag("train_files", write_jsonl(tmp_path / "tasks.jsonl", RECORDS[env])), "--data.seq_len=96",
            "--grpo.max_response_tokens=16"]
  else:
    data = EPISODES
  assert cli.main(["grpo", "--out", str(out), "--env", env, *start, *SHAPE, *data]) == 0
  records = by_step(out)
  assert sorted(records) == [1]
  record = records[1]
  assert math.isfinite(record["loss"]) and record["actor/grad_norm"] > 0
  # Every sample is scored: a random model's failures are its own (reward 0), never dropped as infrastructure's.
  assert 0.0 <= record["reward/mean"] <= 1.0 and record.get("reward/unscored_frac", 0.0) == 0.0
  if env not in RECORDS:
    assert record["episodes/turns_mean"] >= 1 and record["episodes/tokens_environment_mean"] > 0
  return record


@pytest.mark.slow
@pytest.mark.parametrize("env", ["exact_answer", "code", "calculator", "terminal", "docqa"])
def test_each_environment_fine_tunes_a_checkpoint_from_the_command_line(env, ptx_checkpoint, tmp_path):
  _train(tmp_path, env, "--model-dir", str(ptx_checkpoint))


@pytest.mark.slow
def test_code_trains_a_fresh_model_from_the_command_line(tmp_path):
  _train(tmp_path, "code", "--model.n_layers=1", "--model.d_model=64", "--model.mlp_dim=128")


@pytest.mark.slow
def test_a_mixture_of_environments_fine_tunes_a_checkpoint_and_reports_each_ones_reward(ptx_checkpoint, tmp_path):
  # The calculator run's shapes (its programs are compiled already in this worker), its tasks mixed 1:2 with
  # reasoning-gym's: each step's metrics carry the mean reward of every environment its batch drew from.
  pytest.importorskip("reasoning_gym")
  from ptx.envs.calculator import CalculatorTasks
  from ptx.envs.mixture import MixedTasks

  record = _train(tmp_path, "calculator,reasoning_gym:2", "--families", "gcd", "--model-dir", str(ptx_checkpoint))
  drawn = {MixedTasks(("calculator", "reasoning_gym"), (CalculatorTasks(0), CalculatorTasks(0)), (1.0, 2.0))[i]["env"]
           for i in range(8)}  # the first batch's environments (the draw reads the weights, not the sources)
  assert drawn == {"calculator", "reasoning_gym"}
  rewards = {k.removeprefix("episodes/reward/"): v for k, v in record.items() if k.startswith("episodes/reward/")}
  assert set(rewards) == drawn and all(0.0 <= v <= 1.0 for v in rewards.values())
