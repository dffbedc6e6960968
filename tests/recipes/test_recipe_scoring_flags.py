"""The host-reward recipes take `ptx grpo`'s scoring flags (`ptx.scoring_flags`): local or on a Ray cluster."""

import pathlib
import runpy

import pytest

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(autouse=True)
def recipes_importable(monkeypatch):
  monkeypatch.syspath_prepend(str(RECIPES))  # as `python recipes/x.py` does


def _parse(*flags):
  import launch
  return launch.parse("doc", {"tiny": None}, ["--out", "/tmp/unused", *flags], scoring="reward")[0]


def test_the_flags_become_the_rewards_options():
  assert _parse().reward_options == {"concurrency": 32, "timeout_s": None}
  assert _parse("--score-concurrency=4", "--score-timeout-s=30").reward_options == {"concurrency": 4,
                                                                                    "timeout_s": 30.0}
  pytest.importorskip("ray")  # the ray extra (`make test` installs it)
  from ptx.scheduling.ray_executor import RayExecutor
  options = _parse("--executor=ray", "--ray-address=HEAD:6379", "--ray-resources=num_cpus=1,sandbox=1").reward_options
  executor = options.pop("executor")
  # Nothing connects before the first job: the address and resources are what each task will ask for.
  assert isinstance(executor, RayExecutor) and executor.address == "HEAD:6379"
  assert executor.resources.custom == {"sandbox": 1.0} and executor.resources.num_cpus == 1
  assert options == {"concurrency": 32, "timeout_s": 600.0}  # a lost job cannot stall training


@pytest.mark.parametrize("recipe", ["grpo_code", "grpo_math"])
@pytest.mark.parametrize("flags, message", [
    (["--ray-address=auto"], "--ray-address needs --executor=ray"),
    (["--score-concurrency=0"], "--score-concurrency must be >= 1, got 0"),
    (["--executor=ray", "--ray-resources=sandbox"], "'sandbox' is not NAME=NUMBER"),
    (["--warm-pool=4"], "--warm-pool prepares terminal workspaces"),
])
def test_a_recipe_refuses_bad_scoring_flags_by_name_before_it_runs(recipe, flags, message, tmp_path, capsys):
  main = runpy.run_path(str(RECIPES / f"{recipe}.py"), run_name=recipe)["main"]
  with pytest.raises(SystemExit) as exit_:
    main(["--preset", "tiny", "--out", str(tmp_path), *flags])
  assert exit_.value.code == 2 and message in capsys.readouterr().err
  assert not any(tmp_path.iterdir())  # refused before writing anything


def _shell_options(*flags):
  import argparse

  from ptx import scoring_flags

  parser = argparse.ArgumentParser()
  scoring_flags.add_arguments(parser)
  return scoring_flags.shell_options(parser.parse_args(flags))


def test_the_flags_become_the_terminal_environments_options():
  local = _shell_options("--warm-pool=3", "--score-timeout-s=30")
  pool = local.pop("pool")
  try:
    assert pool.size == 3 and pool._scheduler.executor.__class__.__name__ == "LocalExecutor"
  finally:
    pool.close()
  assert local == {"executor": None, "concurrency": 32, "job_timeout_s": 30.0}
  assert _shell_options()["pool"] is None  # --warm-pool=0, the default: off
  pytest.importorskip("ray")
  on_ray = _shell_options("--executor=ray", "--warm-pool=2", "--score-concurrency=8")
  try:  # the pool prepares where the commands run, as many at once
    assert on_ray["pool"]._scheduler.executor is on_ray["executor"] and on_ray["pool"]._scheduler.concurrency == 8
  finally:
    on_ray["pool"].close()
  assert on_ray["job_timeout_s"] == 600.0  # a lost command cannot stall training


@pytest.mark.parametrize("flags, message", [
    (["--warm-pool=-2"], "--warm-pool must be >= 0 (0: off), got -2"),
    (["--ray-address=auto"], "--ray-address needs --executor=ray"),
    (["--executor=ray", "--score-timeout-s=0"], "--score-timeout-s must be > 0, got 0.0"),
])
def test_the_agent_recipe_refuses_bad_flags_by_name_before_it_runs(flags, message, tmp_path, capsys):
  main = runpy.run_path(str(RECIPES / "grpo_agent.py"), run_name="grpo_agent")["main"]
  with pytest.raises(SystemExit) as exit_:
    main(["--preset", "tiny", "--out", str(tmp_path), *flags])
  assert exit_.value.code == 2 and message in capsys.readouterr().err
  assert not any(tmp_path.iterdir())  # refused before writing anything
