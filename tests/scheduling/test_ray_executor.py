"""ptx.scheduling.ray_executor on a local Ray cluster of several nodes: the same outcomes as the local executor.

The process's cluster serves the module (`ray_cluster`: a head and a worker node, one CPU slot each); the node-loss
test adds a third node and kills it. Jobs travel by pickle, their functions by reference (the workers find tests/ on
their path: ray_executor_jobs, which imports no ptx, and this module), and count their attempts in files (a job on
a node has no memory of the last one).
"""

import asyncio
import dataclasses
import functools
import os
import pathlib

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import ray_cluster  # noqa: E402
import ray_executor_jobs as ray_jobs  # noqa: E402
from stepping import run_steps  # noqa: E402
from ptx import cli  # noqa: E402
from ptx.config import GRPOConfig, MeshConfig, OptimizerConfig  # noqa: E402
from ptx.data.arithmetic import ArithmeticTask  # noqa: E402
from ptx.data.tokenizer import ByteTokenizer  # noqa: E402
from ptx.scheduling import scheduler as sched  # noqa: E402
from ptx.envs.base import Outcome, SingleTurn, Step  # noqa: E402
from ptx.scheduling.executors import LocalExecutor  # noqa: E402
from ptx.scheduling.work import Resources  # noqa: E402
from ptx.train.grpo.prompts import PromptBatches  # noqa: E402
from ptx.scheduling.ray_executor import RayExecutor  # noqa: E402
from ptx.sharding import make_mesh  # noqa: E402
from ptx.train.optimizer import make_optimizer  # noqa: E402
from ptx.data.lookahead import Lookahead  # noqa: E402
from ptx.episodes.scoring import EnvReward  # noqa: E402
from ptx.train.grpo.host import HostRewardStep  # noqa: E402
from ptx.train.grpo.update import RLSpec  # noqa: E402
from ptx.train.state import init_state, state_shardings  # noqa: E402

TOK = ByteTokenizer()


cluster = ray_cluster.fixture()


def _mixed_jobs(n: int, root: pathlib.Path) -> list[sched.Work]:
  root.mkdir()
  kinds = [ray_jobs.kind(i) for i in range(n)]
  return [sched.Work(functools.partial(ray_jobs.mixed, i, kind, str(root), os.getpid()), key=(i, kind),
                     timeout_s=0.5 if kind == "hanging" else None) for i, kind in enumerate(kinds)]


def _run(jobs, executor, concurrency, **kw):
  """(scheduler, results) of `jobs` run to the end."""
  async def main():
    async with sched.Scheduler(concurrency, executor=executor, **kw) as s:
      return s, await s.run(jobs)
  return asyncio.run(main())


@pytest.mark.slow
def test_a_thousand_mixed_jobs_end_with_the_local_executors_exact_counts(cluster, tmp_path):
  # Every kind of job, each many times, through Ray's queue: what the executor must keep. The scheduler's own
  # 10,000-job run (tests/scheduling/test_scheduler.py) checks the counts at scale; here more jobs only add time.
  n = 1_000
  # Generous per-attempt timeouts for the jobs that return: a loaded machine must not time them out.
  retry = sched.Retry(attempts=3, base_s=0.001, max_s=0.01)
  local, local_results = _run(_mixed_jobs(n, tmp_path / "local"), LocalExecutor(), 8, timeout_s=120, retry=retry)
  # 8 attempts in flight for 2 slots: Ray queues some (faster), which the generous timeouts allow for.
  remote, remote_results = _run(_mixed_jobs(n, tmp_path / "ray"), RayExecutor(), 8, timeout_s=120, retry=retry)
  per_thousand = n // 1000
  dropped = sum(ray_jobs.PER_1000[k] for k in ("wrong", "crashing", "dead")) * per_thousand + len(ray_jobs.HANGING)
  expected = {"ok": n - dropped, "wrong": 100 * per_thousand, "crashed": 50 * per_thousand,
              "infra_error": 5 * per_thousand, "timeout": len(ray_jobs.HANGING)}
  assert dict(local.counts) == expected
  assert dict(remote.counts) == dict(local.counts)
  assert [(r.key, r.outcome, r.attempts) for r in remote_results] == [(r.key, r.outcome, r.attempts)
                                                                      for r in local_results]
  assert remote.retries == local.retries == per_thousand * (20 * 2 + 10 + 5 * 2) + len(ray_jobs.WORKER_KILLERS)
  crashes = [(r.error, r.value) for r in remote_results if r.outcome == "crashed"]
  assert crashes == [(r.error, r.value) for r in local_results if r.outcome == "crashed"]
  assert all("ValueError('bug in instance" in error for error, _ in crashes)
  # Every attempt left its file once: nothing ran twice, on any node.
  assert sorted(os.listdir(tmp_path / "ray")) == sorted(os.listdir(tmp_path / "local"))


def test_a_node_killed_mid_run_loses_no_job_and_runs_none_twice(cluster, tmp_path):
  doomed = cluster.add_node(num_cpus=1, resources={"sandbox": 1})
  cluster.wait_for_nodes()
  n, root = 200, str(tmp_path)
  # Only the worker node and the joining one offer "sandbox", one slot each. The worker node's first job waits for
  # the kill, so Ray places the next one on the joining node, where it blocks until that node dies.
  executor = RayExecutor(resources=Resources(num_cpus=1, custom={"sandbox": 1}))
  jobs = [sched.Work(functools.partial(ray_jobs.blocks_on_doomed_node, i, root, doomed.node_id), key=i)
          for i in range(n)]

  async def main():
    async with sched.Scheduler(4, executor=executor, timeout_s=300,
                               retry=sched.Retry(attempts=3, base_s=0.01, max_s=0.1)) as s:
      results = asyncio.gather(*[s.submit(job) for job in jobs])
      while not any(name.startswith("doomed.") for name in os.listdir(root)):
        await asyncio.sleep(0.05)  # polls for a job running there; no deadline: the per-job timeout bounds it
      await asyncio.to_thread(cluster.remove_node, doomed, allow_graceful=False)
      pathlib.Path(root, "killed").touch()
      return s, await results

  s, results = asyncio.run(main())
  stranded = {int(name.split(".")[1]) for name in os.listdir(root) if name.startswith("doomed.")}
  assert dict(s.counts) == {"ok": n}
  assert sorted(int(name.split(".")[1]) for name in os.listdir(root) if name.startswith("done.")) == list(range(n))
  assert all(r.attempts == (2 if r.key in stranded else 1) for r in results), results
  assert s.retries == len(stranded) >= 1


def test_higher_priority_runs_first_on_the_cluster_under_contention(cluster):
  priorities = [3, -1, 7, 0, 7, 2, -5, 3, 9, 0]
  order = []

  async def main():
    # One attempt at a time for ten jobs: each waits for the one before it, so the order of results is the order
    # in which they ran.
    async with sched.Scheduler(1, executor=RayExecutor()) as s:
      futures = [s.submit(sched.Work(functools.partial(ray_jobs.ran, f"{i}:{p}"), key=i, priority=p))
                 for i, p in enumerate(priorities)]
      for f in futures:
        f.add_done_callback(lambda f: order.append(f.result().value))
      await asyncio.gather(*futures)

  asyncio.run(main())
  assert order == [f"{i}:{p}" for i, p in sorted(enumerate(priorities), key=lambda ip: (-ip[1], ip[0]))]


def test_a_job_that_does_not_pickle_is_refused_at_submit_naming_it(cluster):
  import threading

  lock = threading.Lock()

  async def holds_a_lock():
    return lock.locked()

  async def main():
    async with sched.Scheduler(1, executor=RayExecutor()) as s:
      s.submit(sched.Work(holds_a_lock, key="task-7"))

  with pytest.raises(TypeError, match=r"Work 'task-7' cannot run on Ray: its fn does not pickle"):
    asyncio.run(main())


def _even_bytes(action: str) -> Step:
  """The fraction of the completion's bytes that are even: a reward a random model earns in varied amounts."""
  data = action.encode()
  reward = sum(b % 2 == 0 for b in data) / max(len(data), 1)
  return Step.final(Outcome.OK if reward > 0.5 else Outcome.WRONG, "", reward)


@dataclasses.dataclass(frozen=True)
class _EvenBytesEnv:
  name: str = "even_bytes"
  max_turns: int = 1

  def reset(self, task):
    return SingleTurn(task["prompt"], _even_bytes)


class _ScoredBothWays:
  """The host reward on the Ray executor (what trains), each batch also scored by the local one for comparison."""

  def __init__(self):
    self.ray = EnvReward(_EvenBytesEnv(), TOK, (TOK.eos_id,), 2, concurrency=2, timeout_s=120, executor=RayExecutor())
    self.local = EnvReward(_EvenBytesEnv(), TOK, (TOK.eos_id,), 2)
    self.batches = []

  def __call__(self, tokens, lengths, tasks):
    on_ray = self.ray(tokens, lengths, tasks)
    self.batches.append((on_ray, self.local(tokens, lengths, tasks)))
    return on_ray


@pytest.mark.slow
def test_host_reward_grpo_trains_on_ray_with_the_local_executors_rewards(cluster, tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  optimizer = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0), 10)
  spec = RLSpec(model=cfg, grpo=GRPOConfig(group_size=2, beta=0.0, kl_placement="none"), max_new_tokens=6,
                stop_ids=(TOK.eos_id,), pad_id=TOK.pad_id)
  data = Lookahead(PromptBatches(ArithmeticTask(0, 2), TOK, batch_size=8, prompt_len=8, answer_width=None))
  reward = _ScoredBothWays()
  shardings = state_shardings(cfg, optimizer, mesh)
  step = HostRewardStep(spec=spec, optimizer=optimizer, mesh=mesh, state_shardings=shardings, reward=reward,
                        prompts=data)
  _, history = run_steps(step, init_state(cfg, optimizer, 0, mesh), data, 2)
  # The same completions (one seed, one run) get the same rewards on either executor, exactly: one Python function.
  for on_ray, local in reward.batches:
    np.testing.assert_array_equal(on_ray, local)
  assert len({float(r) for on_ray, _ in reward.batches for r in on_ray}) > 2  # varied: a wrong score would show
  for (on_ray, _), metrics in zip(reward.batches, history):
    np.testing.assert_allclose(metrics["reward/mean"], on_ray.mean(), rtol=1e-6)  # float32 sums in another order


@pytest.mark.parametrize("flags, message", [
    (["--executor=ray"], "--executor=ray scores rl records on the host (--data.train_files"),
    (["--executor=ray", "--env=calculator", "{data}"], "--executor=ray scores rl records on the host"),
    (["--executor=ray", "--ray-resources=num_cpus=1,sandbox", "{data}"], "'sandbox' is not NAME=NUMBER"),
    (["--ray-address=auto", "{data}"], "--ray-address needs --executor=ray"),
    (["--score-concurrency=0", "{data}"], "--score-concurrency must be >= 1, got 0"),
    (["--executor=ray", "--score-timeout-s=-1", "{data}"], "--score-timeout-s must be > 0, got -1.0"),
    (["--executor=ray", "--env=docqa"], "--env calculator, docqa or bfcl run in this process"),
    (["--executor=ray", "--env=reasoning_gym,bfcl"], "mixtures of environments and --env calculator"),
    (["--warm-pool=2", "{data}"], "--warm-pool needs --env terminal (it prepares terminal workspaces ahead), got "
                                  "--env exact_answer"),
    (["--env=terminal", "--warm-pool=-1"], "--warm-pool must be >= 0 (0: off), got -1"),
    (["--env=terminal", "--executor=ray", "--score-concurrency=0"], "--score-concurrency must be >= 1, got 0"),
])
def test_grpo_executor_flags_refuse_what_they_cannot_do_naming_the_flag(tmp_path, capsys, flags, message):
  data = tmp_path / "rl.jsonl"
  data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
  flags = [f.format(data=f"--data.train_files=[\"{data}\"]") for f in flags]
  with pytest.raises(SystemExit) as exit_:
    cli.main(["grpo", "--out", str(tmp_path / "run"), "--no-progress", *flags])
  assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_code_is_scored_in_the_sandbox_on_the_nodes_as_it_is_here(cluster):
  from ptx.episodes import scoring
  from ptx.envs.python_tests import PythonTestsEnv

  task = {"prompt": "def double(x):", "tests": ["assert double(2) == 4", "assert double(-1) == -2"]}
  completions = ["def double(x):\n  return 2 * x\n", "def double(x):\n  return x + 2\n", "import os; os._exit(3)"]
  kw = dict(concurrency=2, timeout_s=120)
  on_ray = scoring.score(PythonTestsEnv(), [task] * 3, completions, executor=RayExecutor(), **kw)
  here = scoring.score(PythonTestsEnv(), [task] * 3, completions, **kw)
  assert [(s.outcome, s.reward) for s in on_ray] == [(s.outcome, s.reward) for s in here]
  assert [s.reward for s in on_ray] == [1.0, 0.0, 0.0] and on_ray[2].outcome != "infra_error"


def test_a_job_no_node_can_take_ends_at_its_timeout_and_frees_its_slot(cluster):
  # No node offers "gpu_sandbox": Ray keeps the tasks pending (a node might join); the scheduler's timeout ends them.
  executor = RayExecutor(resources=Resources(num_cpus=1, custom={"gpu_sandbox": 1}))

  async def main():
    async with sched.Scheduler(1, executor=executor, timeout_s=0.5) as s:
      results = await s.run([sched.Work(functools.partial(ray_jobs.ran, "never"), key=i) for i in range(2)])
    return s, results

  s, results = asyncio.run(main())
  assert [(r.outcome, r.attempts) for r in results] == [("timeout", 1), ("timeout", 1)]
  assert dict(s.counts) == {"timeout": 2} and s.in_flight == 0
