"""Draft models distilled from the policy (#29 item 1b): trained on the policy's own samples, they are accepted more."""

import jax
import numpy as np
import pytest

from ptx.config import MeshConfig
from ptx.models import init_params
from ptx.models.llama import tiny
from ptx.sampling import SamplingConfig
from ptx.sampling.engine.drafters import DraftModel
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.speculative import SpeculativeConfig, SpeculativeEngine
from ptx.sharding import make_mesh
from ptx.train.draft_distillation import Distillation, cut, distill, policy_rows

GREEDY = SamplingConfig(greedy=True)
NEW = 24


def _prompts(n, seed):
  rng = np.random.default_rng(seed)
  return [[1] + rng.integers(3, 512, 7).tolist() for _ in range(n)]


def _acceptance(params, cfg, draft_cfg, draft_params, prompts):
  """Accepted over drafted tokens of greedy speculative decoding of `prompts` with the draft model."""
  config = EngineConfig(max_seqs=len(prompts), pages=len(prompts) * 3 + 1, page_size=16, max_seq_len=8 + NEW,
                        decode_steps=4, prefill_chunk=8, prefill_rows=len(prompts))
  engine = SpeculativeEngine(cfg, config, sampling=GREEDY, drafter=DraftModel(draft_params, draft_cfg, window=16),
                             speculative=SpeculativeConfig(drafts=3, verify_cost=1.0))
  for p in prompts:
    engine.submit(p, max_new_tokens=NEW)
  done = engine.run(params).values()
  return sum(c.accepted for c in done) / sum(c.drafted for c in done)


@pytest.fixture(scope="module")
def policy():
  cfg = tiny()
  return cfg, init_params(cfg, jax.random.key(3))


def test_a_distilled_draft_is_accepted_more_on_the_prompts_it_serves(policy):
  """RL samples the same prompts epoch after epoch, so a draft distilled on them serves them; held-out acceptance
  is printed (a random policy's greedy map is hard to generalise from 48 prompts)."""
  cfg, params = policy
  train, held_out = _prompts(48, seed=0), _prompts(8, seed=1)
  assert not {tuple(p) for p in train} & {tuple(p) for p in held_out}  # disjoint by construction of the seeds
  draft_cfg, start = cut(params, cfg, 1)
  d = Distillation(samples=1, max_new_tokens=NEW, sampling=GREEDY, steps=60, batch_size=8)
  # One device: the draft's training step is the trainer's (its meshes are tested with it), and 8-way FSDP of a
  # 1-layer model costs collectives every step on the fake CPU devices.
  mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
  trained, losses = distill(params, cfg, draft_cfg, start, train, d, mesh)
  served = [_acceptance(params, cfg, draft_cfg, p, train[:8]) for p in (start, trained)]
  unseen = [_acceptance(params, cfg, draft_cfg, p, held_out) for p in (start, trained)]
  print(f"acceptance: trained prompts {served[0]:.3f} -> {served[1]:.3f}, held-out {unseen[0]:.3f} -> "
        f"{unseen[1]:.3f}; loss {np.mean(losses[:10]):.3f} -> {np.mean(losses[-10:]):.3f}")
  assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
  assert served[1] > served[0] + 0.2


def test_policy_rows_put_the_loss_on_the_completions_alone(policy):
  cfg, params = policy
  prompts = [[1, 5, 6], [1, 7, 8, 9, 10]]
  rows = policy_rows(params, cfg, prompts, Distillation(samples=2, max_new_tokens=4, sampling=GREEDY))
  assert rows["tokens"].shape == (4, 16)
  np.testing.assert_array_equal(rows["loss_mask"].sum(1), [4, 4, 4, 4])
  np.testing.assert_array_equal(rows["segment_ids"].sum(1), [7, 7, 9, 9])
  np.testing.assert_array_equal(rows["tokens"][2, :5], prompts[1])
  assert rows["loss_mask"][2, :5].sum() == 0 and rows["loss_mask"][2, 5:9].all()
  np.testing.assert_array_equal(rows["tokens"][2], rows["tokens"][3])  # greedy: a prompt's samples agree


def test_bad_settings_are_refused_by_name(policy):
  cfg, params = policy
  with pytest.raises(ValueError, match=r"cut: n_layers must be in \[1, 2\]"):
    cut(params, cfg, 3)
  with pytest.raises(ValueError, match="Distillation.steps must be >= 1"):
    Distillation(steps=0)
  other = tiny().__class__(**{**tiny().__dict__, "vocab_size": 256})
  with pytest.raises(ValueError, match=r"the draft's vocab_size \(256\) must be the policy's \(512\)"):
    distill(params, cfg, other, init_params(other, jax.random.key(0)), [[1, 2]], Distillation(), None)
