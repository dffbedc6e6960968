"""The host-reward recipes take `ptx grpo`'s scoring flags (`ptx.rl.scoring_flags`): local or on a Ray cluster."""

import pathlib
import runpy

import pytest

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(autouse=True)
def recipes_importable(monkeypatch):
  monkeypatch.syspath_prepend(str(RECIPES))  # as `python recipes/x.py` does


def _parse(*flags):
  import launch
  return launch.parse("doc", {"tiny": None}, ["--out", "/tmp/unused", *flags], scoring=True)[0]


def test_the_flags_become_the_rewards_options():
  assert _parse().reward_options == {"concurrency": 32, "timeout_s": None}
  assert _parse("--score-concurrency=4", "--score-timeout-s=30").reward_options == {"concurrency": 4,
                                                                                    "timeout_s": 30.0}
  pytest.importorskip("ray")  # the ray extra (`make test` installs it)
  from ptx.rl.ray_executor import RayExecutor
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
])
def test_a_recipe_refuses_bad_scoring_flags_by_name_before_it_runs(recipe, flags, message, tmp_path, capsys):
  main = runpy.run_path(str(RECIPES / f"{recipe}.py"), run_name=recipe)["main"]
  with pytest.raises(SystemExit) as exit_:
    main(["--preset", "tiny", "--out", str(tmp_path), *flags])
  assert exit_.value.code == 2 and message in capsys.readouterr().err
  assert not any(tmp_path.iterdir())  # refused before writing anything
