"""`ptx grpo --env terminal --executor=ray`: episodes' commands on a local Ray cluster train as they do here.

Two runs of the same command, one with `--executor=local`, one with `--executor=ray --ray-address=<the cluster>`,
each with a warm pool; the same seed plays the same tokens, so every metric but the wall-clock ones must be equal.
"""

import json

import pytest

import ray_cluster

ray = pytest.importorskip("ray")

from ptx import cli  # noqa: E402
from ptx.scheduling.ray_executor import RayExecutor  # noqa: E402

cluster = ray_cluster.fixture()

# A tiny model and batch: 4 tasks x 2 episodes a step (the batch over fsdp, the model over tensor), two commands an
# episode (the second also runs the check), short prompts. The entropy bonus and the KL term give gradients while a
# group's rewards are equal.
COMMON = ["--no-progress", "--no-export", "--env", "terminal", "--warm-pool=4", "--model.n_layers=1",
          "--model.d_model=64", "--model.mlp_dim=128", "--train.steps=2", "--train.log_every=1",
          "--train.checkpoint_every=100", "--data.batch_size=4", "--data.seq_len=256", "--grpo.group_size=2",
          "--grpo.entropy_coef=0.05", "--grpo.beta=0.04", "--grpo.kl_placement=loss", "--grpo.max_staleness=0",
          "--grpo.turn_tokens=8", "--grpo.max_response_tokens=256", "--mesh.data=1", "--mesh.fsdp=4",
          "--mesh.tensor=2"]
WALL_CLOCK = ("steps_per_s", "samples_per_s", "tokens_per_s", "timing_s/", "perf/")


def _records(tmp_path):
  """Shell tasks with a set-up (made by the warm pool) and a check that passes for some commands and not others."""
  path = tmp_path / "tasks.jsonl"
  # Odd tasks ask for a file no command of a random model makes: their checks fail, the others' pass.
  rows = [{"prompt": f"Keep b.txt ({i} lines).", "files": {"a.txt": f"{i}\n"}, "setup": f"seq {i} > b.txt",
           "check": f"test $(cat b.txt | wc -l) -eq {i} && test {'' if i % 2 else '!'} -e made_by_you",
           "max_turns": 2} for i in range(1, 5)]
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return path


def _run(out, data, *flags):
  assert cli.main(["grpo", "--out", str(out), f"--data.train_files=[\"{data}\"]", *COMMON, *flags]) == 0
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in records if "step" in r]


@pytest.mark.slow
def test_grpo_on_terminal_episodes_on_ray_trains_as_it_does_here(cluster, tmp_path, monkeypatch):
  data = _records(tmp_path)
  local = _run(tmp_path / "local", data, "--executor=local")
  jobs = []
  bind = RayExecutor.bind
  monkeypatch.setattr(RayExecutor, "bind", lambda self, job: jobs.append(job.key) or bind(self, job))
  on_ray = _run(tmp_path / "ray", data, "--executor=ray", f"--ray-address={cluster.address}",
                "--ray-resources=num_cpus=1,sandbox=1", "--score-concurrency=2")
  assert [r["step"] for r in local] == [1, 2] and [sorted(r) for r in on_ray] == [sorted(r) for r in local]
  for here, there in zip(local, on_ray):
    # What the episodes did, exactly: the same commands, outputs, checks and rewards.
    exact = [k for k in here if k.startswith(("episodes/", "reward/", "frac_reward"))]
    assert {k: there[k] for k in exact} == {k: here[k] for k in exact}
    # The update: the same tokens and rewards, but the engine's sampling log-probs round differently when other
    # episodes share a decode step (which tool timing decides; 1e-8 seen in actor/ppo_kl): float32 rounding.
    assert there == pytest.approx(here, rel=1e-5, abs=1e-6)
  # Commands, checks and the pool's set-ups all ran as Ray tasks (on the node offering "sandbox").
  assert {"run_command", "judge"} <= set(jobs) and any(isinstance(k, tuple) and k[0] == "prepare" for k in jobs)
  for r in local:  # each episode ran its commands, and the check judged it
    assert r["episodes/tool_calls_mean"] > 0 and r["episodes/infra_error_frac"] == 0
    assert 0 < r["reward/mean"] < 1 and r["episodes/outcome/ok"] + r["episodes/outcome/wrong"] == 1.0
