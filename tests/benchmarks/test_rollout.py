"""benchmarks/rollout.py: the `stops` model it trains once, and the methods it refuses before any work.

The model is written once and read back only by a run that asks for the same recipe and shapes.
"""

import argparse
import dataclasses
import pathlib
import sys

import jax
import numpy as np
import pytest

SCRIPT_DIR = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def rollout():
  sys.path.insert(0, str(SCRIPT_DIR))
  import rollout
  return rollout


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
