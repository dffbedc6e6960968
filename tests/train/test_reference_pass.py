"""DPO with reference log-probs precomputed in one pass equals DPO with a frozen reference copy, without the copy."""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

from tolerances import ADAM_EPS
from ptx.config import Config, DataConfig, DPOConfig, MeshConfig, OptimizerConfig, TrainConfig
from ptx.data.pipeline import make_pipeline
from ptx.data.sources import MemorySource
from ptx.data.tokenizer import ByteTokenizer
from ptx.train import reference_pass
from ptx.train.job import dpo_job
from ptx.train.loop import fit

TOK = ByteTokenizer()
PAIRS = [{"prompt": f"{i}+{i % 7}=", "chosen": str(i + i % 7), "rejected": str(i * 3 + 1)} for i in range(40)]


@pytest.fixture
def cfg(tiny_config):
  return Config(model=dataclasses.replace(tiny_config, n_layers=1), mesh=MeshConfig(data=2, fsdp=4),
                optim=OptimizerConfig(lr=3e-3, warmup_steps=2, eps=ADAM_EPS), train=TrainConfig(steps=6, log_every=1),
                data=DataConfig(kind="preference", batch_size=8, seq_len=16, pack=False, seed=3),
                dpo=DPOConfig(beta=0.5, reference="precomputed"))


def _losses(out):
  return [(r["step"], r["loss"], r["rewards/margins"]) for r in map(json.loads, (out / "metrics.jsonl").open())
          if "loss" in r]


def test_precomputed_reference_trains_exactly_like_the_frozen_copy(cfg, tmp_path):
  source = MemorySource(PAIRS)
  pipeline = functools.partial(make_pipeline, tokenizer=TOK)
  frozen_cfg = dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, reference="frozen"))
  frozen_state, _ = fit(frozen_cfg, dpo_job(frozen_cfg, TOK), train_data=pipeline(source, cfg=cfg.data),
                        out=tmp_path / "frozen", progress=False)
  table_path = tmp_path / "pre" / "reference_logps" / "train.npy"
  data = reference_pass.with_reference_table(pipeline(source, cfg=cfg.data), source=source, pipeline=pipeline,
                                             cfg=cfg, path=table_path)
  state, _ = fit(cfg, dpo_job(cfg, TOK), train_data=data, out=tmp_path / "pre", progress=False)
  assert state.ref_params is None and frozen_state.ref_params is not None  # no second parameter tree
  # The table and the frozen copy's log-probs come from two programs (bit-equal here). An ulp of one sequence's
  # log-prob near -70 (7.6e-6) would move its pair's loss by ~2e-6 and the mean over 8 pairs by ~2e-7, inside these
  # tolerances; ADAM_EPS keeps such differences from growing over the 6 updates (tolerances.py).
  np.testing.assert_allclose(_losses(tmp_path / "pre"), _losses(tmp_path / "frozen"), rtol=1e-6, atol=1e-6)
  for ours, theirs in zip(jax.tree.leaves(state.params), jax.tree.leaves(frozen_state.params)):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-6)
  table = np.load(table_path)
  assert table.shape == (len(PAIRS), 2) and np.isfinite(table).all() and (table < 0).all()


def test_a_saved_table_is_reused_and_a_mismatched_one_is_an_error(cfg, tmp_path):
  path = tmp_path / "t.npy"
  table = np.arange(8, dtype=np.float32).reshape(4, 2)
  np.save(path, table)
  np.testing.assert_array_equal(reference_pass.load_or_precompute(path, lambda: pytest.fail("recomputed"), 4), table)
  with pytest.raises(ValueError, match=r"t.npy: reference table of shape \(4, 2\), but the data has 5 records"):
    reference_pass.load_or_precompute(path, lambda: table, 5)


def test_a_pair_the_pass_never_scored_is_an_error():
  batches = [{"record_index": np.asarray([0, 1], np.int32)}]
  table = np.asarray([[-1.0, -2.0], [np.nan, np.nan]], np.float32)
  with pytest.raises(ValueError, match=r"records \[1\] have no precomputed reference"):
    next(iter(reference_pass.WithReferenceLogps(batches, table)))
