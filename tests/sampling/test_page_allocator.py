"""Pages: reference counts and free lists; the engine serves 1,000 random requests within its budget, leaking none."""

import collections

import jax
import numpy as np
import pytest

from ptx.model_config import ModelConfig
from ptx.models import init_params
from ptx.sampling import LENGTH, STOP, SamplingConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.pages import PageAllocator


def test_shared_pages_return_when_their_last_holder_releases_them():
  pages = PageAllocator(pages=10, blocks=2)
  assert pages.capacity == 4 and pages.free_pages(0) == pages.free_pages(1) == 4
  first = pages.allocate(0, 3)
  assert first == [1, 2, 3]  # lowest ids first; 0 is the sink
  pages.share(0, first[:2])
  pages.release(0, first)
  assert pages.free_pages(0) == 2 and pages.in_use == 2  # pages 1 and 2 still have a holder
  pages.release(0, first[:2])
  assert pages.free_pages(0) == 4 and pages.in_use == 0 and pages.peak_in_use == 3
  assert pages.free_pages(1) == 4  # the other block was never touched


def test_misuse_raises_and_takes_nothing():
  pages = PageAllocator(pages=6)
  held = pages.allocate(0, 2)
  with pytest.raises(ValueError, match="block 0 has 3 free pages, 4 asked for"):
    pages.allocate(0, 4)
  assert pages.free_pages(0) == 3
  with pytest.raises(ValueError, match=r"cannot release pages \[1\] of block 0: not held"):
    pages.release(0, [held[0], held[0]])  # one holder, two releases
  with pytest.raises(ValueError, match="ids are 1..5"):
    pages.share(0, [0])  # the sink is never handed out
  with pytest.raises(ValueError, match="not held"):
    pages.share(0, [5])
  with pytest.raises(ValueError, match="leave no page besides"):
    PageAllocator(pages=2, blocks=2)


def _holdings(engine):
  """Pages per (block, page) that the engine's own sequences say they hold (white box: the engine's bookkeeping)."""
  held = collections.Counter()
  for seq in engine._sequences.values():
    held.update((seq.block, page) for page in seq.pages)
  return held


@pytest.mark.parametrize("admission", ["reserve", "on_demand"])
def test_a_thousand_random_requests_stay_within_the_budget_and_leak_nothing(admission):
  cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=16,
                    rope_theta=10_000.0, init_std=0.5)
  params = init_params(cfg, jax.random.key(0))
  # The run's cost is compiling one program per shape bucket (about 2 s each; 600-1,100 compiled steps take ~2 s).
  # 4 slots and pages of 16 positions (at most 4 a sequence, so a call reads 8 or 16 pairs) compile 6 decode,
  # 2 prefill and 2 copy programs, where 16 slots and pages of 4 compiled 29. The pool still binds: its 12 pages
  # hold about three groups (a group of 3 at the 64-position cap needs up to 12, sharing a 16-token prompt page
  # when the prompt is longer), so requests wait for pages, not only for slots.
  # With "on_demand" admission (the same programs) rows take pages call by call, and the last admitted are preempted
  # when a call's pages run out.
  config = EngineConfig(max_seqs=4, pages=13, page_size=16, max_seq_len=64, decode_steps=8, prefill_chunk=16,
                        prefill_rows=2, admission=admission)
  engine = RolloutEngine(cfg, config, sampling=SamplingConfig(temperature=1.0), seed=0)
  rng = np.random.default_rng(0)
  requests, finished, extended = {}, collections.Counter(), 0
  for _ in range(1000):
    prompt = rng.integers(0, 32, rng.integers(1, 30)).tolist()
    budget, stops = int(rng.integers(1, 66 - len(prompt))), rng.integers(0, 32, rng.integers(0, 3)).tolist()
    ids = engine.submit(prompt, max_new_tokens=budget, stop_ids=stops, samples=int(rng.integers(1, 4)),
                        keep=rng.random() < 0.1)
    requests.update((i, (budget, stops)) for i in ids)
  steps = 0
  while engine.busy or any(s.state.value == "held" for s in engine._sequences.values()):
    for completion in engine.step(params):
      budget, stops = requests[completion.seq_id]
      n = len(completion.tokens)
      assert 1 <= n <= budget and len(completion.log_probs) == n
      assert (completion.finish_reason == STOP) == (int(completion.tokens[-1]) in stops), completion
      assert completion.finish_reason in (STOP, LENGTH)
      assert all(int(t) not in stops for t in completion.tokens[:-1])  # it stopped at its first stop id
      finished[completion.seq_id] += 1
    steps += 1
    # The engine's bookkeeping and the allocator's reference counts agree page for page, within the budget.
    held = _holdings(engine)
    assert sum(1 for _ in held) == engine.allocator.in_use <= engine.allocator.capacity
    for (block, page), holders in held.items():
      assert engine.allocator._refs[block, page] == holders
    # Held sequences go on with a tool output once, or are released; a few live ones are dropped mid-turn.
    for seq in list(engine._sequences.values()):
      if seq.state.value == "held":
        tool_output = rng.integers(0, 32, rng.integers(1, 6)).tolist()
        if extended < 40 and rng.random() < 0.5 and seq.length + len(tool_output) + 4 <= config.max_seq_len:
          engine.extend(seq.seq_id, tool_output, max_new_tokens=4)
          requests[seq.seq_id] = (4, list(seq.stop_ids))
          extended += 1
        else:
          engine.release(seq.seq_id)
      elif seq.state.value == "live" and rng.random() < 0.002:
        engine.release(seq.seq_id)
        finished[seq.seq_id] += 1  # dropped: counts as served
    assert steps < 5000
  assert engine.allocator.in_use == 0 and not engine._sequences
  assert engine.allocator.peak_in_use <= engine.allocator.capacity
  assert set(finished) == set(requests)  # every sample of every request was served (or dropped on purpose)
  assert extended > 0
  assert (engine.preemptions > 0) == (admission == "on_demand")
