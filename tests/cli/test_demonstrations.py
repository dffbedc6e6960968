"""`ptx demonstrations`: SFT records of environments' training tasks solved right, the stream `ptx grpo --env` draws
with the same seed, never a held-out task, each record one the SFT data layer reads."""

import json

import pytest

pytest.importorskip("reasoning_gym")  # the rl extra, installed by `make test`
pytest.importorskip("bfcl_eval", reason="BFCL's data comes from bfcl-eval (`make test` installs it with --no-deps)")

from ptx import cli  # noqa: E402 - after the skips
from ptx.data import records  # noqa: E402
from ptx.data.tokenizer import ByteTokenizer  # noqa: E402
from ptx.envs import suites  # noqa: E402
from ptx.envs.base import first_prompt  # noqa: E402
from ptx.envs.bfcl import BFCLEnv, BFCLTasks  # noqa: E402
from ptx.envs.mixture import MixedTasks, MixtureEnv  # noqa: E402
from ptx.envs.reasoning_gym import ReasoningGymEnv, ReasoningGymTasks  # noqa: E402


def test_a_mixture_is_written_as_the_grpo_stream_of_its_seed_solved(tmp_path, capsys):
  out = tmp_path / "demos.jsonl"
  assert cli.main(["demonstrations", "--env", "reasoning_gym:3,bfcl", "--n", "60", "--seed", "4",
                   "--out", str(out)]) == 0
  written = [json.loads(line) for line in out.read_text().splitlines()]
  # The stream `ptx grpo --env reasoning_gym:3,bfcl --train.seed=4` trains on (no --model-dir: the hermes form).
  env = MixtureEnv(("reasoning_gym", "bfcl"), (ReasoningGymEnv(), BFCLEnv()))
  tasks = MixedTasks(env.names, (ReasoningGymTasks(seed=4), BFCLTasks(seed=4)), (3.0, 1.0), seed=4)
  assert [r["messages"][0]["content"] for r in written] == [first_prompt(env, tasks[i]) for i in range(60)]
  labels = [env.label(tasks[i]) for i in range(60)]
  summary = json.loads(capsys.readouterr().out)
  assert summary["by_env"] == {"reasoning_gym": labels.count("reasoning_gym"), "bfcl": labels.count("bfcl")}
  assert 0 < summary["by_env"]["bfcl"] < summary["by_env"]["reasoning_gym"]
  for record, i in zip(written, range(60)):  # each answer is one the environment scores 1, and SFT reads it
    assert env.reset(tasks[i]).step(record["messages"][1]["content"]).reward == 1.0
    assert records.encode("sft", ByteTokenizer(), record, "demos.jsonl:1")["loss_mask"].sum() > 0
  # Never a held-out task: the suites' prompts are not among them.
  held_out = {first_prompt(e, t) for name in ("bfcl", "reasoning_gym")
              for e, ts in [suites.load(name, n=300, tokenizer=ByteTokenizer())] for t in ts}
  assert held_out.isdisjoint(r["messages"][0]["content"] for r in written)


@pytest.mark.parametrize("argv, message", [
    (["--env", "reasoning_gym,code"], "code has no demonstrations; environments with them"),
    (["--env", "terminal"], "terminal has no demonstrations"),
    (["--env", "bfcl", "--n", "0"], "--n must be at least 1, got 0"),
])
def test_environments_without_demonstrations_and_bad_counts_are_refused(argv, message, tmp_path, capsys):
  args = ["demonstrations", "--n", "3", "--out", str(tmp_path / "d.jsonl"), *argv]
  with pytest.raises(SystemExit) as exit_:
    cli.main(args)
  assert exit_.value.code == 2 and message in capsys.readouterr().err
  assert not (tmp_path / "d.jsonl").exists()
