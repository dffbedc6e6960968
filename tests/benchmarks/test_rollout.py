"""benchmarks/rollout.py: the `stops` model it trains once, the methods it refuses, and its reseeded rounds.

The model is written once and read back only by a run that asks for the same recipe and shapes.
"""

import argparse
import dataclasses
import pathlib

import jax
import numpy as np
import pytest


@pytest.fixture(scope="module")
def rollout(import_benchmark):
  return import_benchmark("rollout")


def test_the_stop_model_is_written_once_and_read_back_exactly(rollout, tmp_path):
  path = str(tmp_path / "stop.npz")
  args = argparse.Namespace(config="tiny", train_steps=2, median=16, seed=0, stop_model=path)
  cfg = rollout.CONFIGS["tiny"]
  trained = rollout.stop_model(cfg, args)
  assert pathlib.Path(path).exists() and not pathlib.Path(path + ".tmp").exists()
  read = rollout.stop_model(cfg, args)
  assert jax.tree.structure(read) == jax.tree.structure(trained)
  jax.tree.map(np.testing.assert_array_equal, read, trained)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(
      rollout.init_params(cfg, jax.random.key(0)))))  # it was trained, not initialised

  with pytest.raises(SystemExit, match=r"stop.npz: made with train_steps=2, this run asks for 3"):
    rollout.stop_model(cfg, argparse.Namespace(**{**vars(args), "train_steps": 3}))
  with pytest.raises(SystemExit, match=r"stop.npz: \['embed'\]\S* is missing or not of shape"):
    rollout.stop_model(dataclasses.replace(cfg, vocab_size=cfg.vocab_size * 2), args)


@pytest.mark.parametrize("methods, named", [("static,engin", "engin"), ("static,tunix", "tunix")])
def test_an_unknown_method_is_refused_before_any_work(rollout, methods, named):
  args = rollout.parser().parse_args(["--methods", methods, "--workloads", "uniform"])
  with pytest.raises(SystemExit, match=f"--methods: unknown {named}; known: static, engine,"):
    next(rollout.rows(args))


def test_reseeded_rounds_sample_with_their_own_seed_and_the_summary_gives_each_rounds_ratio(rollout, monkeypatch):
  seen = []

  def fake(method):
    def run(*args, warm_only=False):
      seed = args[-1]
      if not warm_only:
        seen.append((method, seed))
      return {"useful_tokens": 1000 + seed if method == "static" else 3000 + seed, "kv_bytes": 1}
    return run

  monkeypatch.setattr(rollout, "run_static", fake("static"))
  monkeypatch.setattr(rollout, "run_engine", fake("engine"))

  def timed(fn, warm=None):
    record = fn()
    return {**record, "useful_tokens_per_s": record["useful_tokens"]}

  monkeypatch.setattr(rollout, "timed", timed)
  args = rollout.parser().parse_args(["--workloads", "uniform", "--rounds", "3", "--reseed", "--seed", "5"])
  *records, summary = rollout.rows(args)
  assert [(r["method"], r["sampling_seed"]) for r in records] == [
      ("static", 5), ("engine", 5), ("static", 1005), ("engine", 1005), ("static", 2005), ("engine", 2005)]
  assert seen == [(r["method"], r["sampling_seed"]) for r in records]  # the seed reached the sampling, not a label
  assert summary["engine_over_static_per_round"] == [round(3005 / 1005, 2), round(4005 / 2005, 2),
                                                     round(5005 / 3005, 2)]
  assert summary["engine_over_static"] == round(4005 / 2005, 2)  # the medians' ratio

  unseeded = rollout.parser().parse_args(["--workloads", "uniform", "--rounds", "2", "--seed", "5"])
  assert {r["sampling_seed"] for r in rollout.rows(unseeded) if "summary" not in r} == {5}
