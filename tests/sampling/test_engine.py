"""The rollout engine: greedy == `generate` under any admission order, page size and mesh; log-probs == training's;
shared prompt pages == copied ones; the same seed gives the same tokens; multi-turn extends; MLA's latent pages decode
the full forward's tokens; bad requests are named."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from engine_setup import (BUDGETS, ENGINE_VS_TRAINER_ATOL, GREEDY, LONG_BUDGET, N_NEW, PROMPTS, SAMPLED, SHORT, SMALL,
                          TIGHT, argmax_reference, check_greedy, check_on_demand_greedy, forward_jit, greedy_case,
                          greedy_tokens, grouped_equals_copied, perturbed_params, right_padded, run_requests)

from model_variants import gemma_like, mla_like, moe_like
from ptx.models.decoder import token_log_probs
from ptx.models.params import param_shardings
from ptx.sampling import LENGTH, STOP
from ptx.sampling.engine import map_budget, programs
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig


def _variant(tiny_config, variant):
  """The tiny config, or its Gemma-like or Mixture-of-Experts variant."""
  return {"llama": tiny_config, "gemma": gemma_like(tiny_config), "moe": moe_like(tiny_config)}[variant]


@pytest.mark.parametrize("variant, page_size, order", [
    ("llama", 4, "submitted"), ("llama", 16, "reversed"), ("gemma", 3, "shuffled"), ("moe", 4, "shuffled")])
def test_greedy_equals_generate_under_any_order_and_page_size(tiny_config, variant, page_size, order):
  cfg, params, stops, expected = greedy_case(_variant(tiny_config, variant))
  rows = list(range(len(PROMPTS)))
  shuffled = list(np.random.default_rng(3).permutation(rows))
  rows = {"submitted": rows, "reversed": rows[::-1], "shuffled": shuffled}[order]
  # Pages for 4 sequences of max_seq_len; at SMALL's page size, SMALL itself (four of these requests take at most 32
  # of its 63 pages), whose programs the other greedy tests of the llama config compile too.
  config = SMALL if page_size == SMALL.page_size else dataclasses.replace(
      SMALL, pages=4 * -(-64 // page_size) + 1, page_size=page_size)
  got = run_requests(RolloutEngine(cfg, config, sampling=GREEDY), params, rows, stops)
  assert all(len(completions) == 1 for completions in got.values())
  check_greedy(got, expected, range(len(PROMPTS)))


def test_an_engine_whose_compilation_leaves_the_memory_maps_crowded_drops_its_programs_and_samples_on(
    tiny_config, monkeypatch, caplog):
  # Past vm.max_map_count LLVM aborts the process (the GRPO run of SmolLM2 with six evaluation suites did): a set of
  # programs whose call compiled while the maps are crowded drops what it compiled, and compiles again when called.
  cfg, params, stops, expected = greedy_case(tiny_config)
  monkeypatch.setattr(map_budget, "crowded", lambda: True)
  own = programs.Programs()
  got = run_requests(RolloutEngine(cfg, SMALL, sampling=GREEDY, programs=own), params, range(len(PROMPTS)), stops)
  check_greedy(got, expected, range(len(PROMPTS)))
  assert own.compiled == 0 and own.releases >= 2  # a prefill and a decode at least, each dropped after compiling
  assert "dropped the set's 1 compiled program(s)" in caplog.text
  monkeypatch.setattr(map_budget, "crowded", lambda: False)
  kept = programs.Programs()
  run_requests(RolloutEngine(cfg, SMALL, sampling=GREEDY, programs=kept), params, range(len(PROMPTS)), stops)
  assert kept.compiled >= 2 and kept.releases == 0  # kept while the maps have room


def test_the_memory_maps_are_counted_against_the_systems_limit(monkeypatch, tmp_path):
  assert map_budget.limit() > map_budget.held() > 0  # Linux: the limit is read, and this process's maps counted
  assert map_budget.crowded(headroom=1.0) and not map_budget.crowded(headroom=0.0)
  monkeypatch.setattr(map_budget, "LIMIT_FILE", tmp_path / "absent")
  assert map_budget.limit() is None and not map_budget.crowded(headroom=1.0)  # no limit to cross


def test_sharded_engine_equals_generate(tiny_config, mesh):
  """data=2 x tensor=4: pages and slots over data, KV heads over tensor; greedy == generate, groups of 2 too."""
  cfg, params, stops, expected = greedy_case(gemma_like(tiny_config))
  placed = jax.device_put(params, param_shardings(cfg, mesh))
  got = run_requests(RolloutEngine(cfg, SMALL, sampling=GREEDY, mesh=mesh), placed, range(len(PROMPTS)), stops,
                     samples=2)
  check_greedy(got, expected, range(len(PROMPTS)))


def test_sharded_engine_samples_as_one_device(tiny_config, mesh):
  """The same seed samples the same tokens on data=2 x tensor=4 as on one device."""
  cfg = gemma_like(tiny_config)
  params = perturbed_params(cfg)
  placed = jax.device_put(params, param_shardings(cfg, mesh))
  # No stop ids (the greedy test above stops rows on the mesh): one device runs the programs of the sampled tests
  # below.
  no_stops = [[]] * len(PROMPTS)
  sharded = run_requests(RolloutEngine(cfg, SMALL, sampling=SAMPLED, seed=5, mesh=mesh), placed, range(4), no_stops, 2)
  single = run_requests(RolloutEngine(cfg, SMALL, sampling=SAMPLED, seed=5), params, range(4), no_stops, 2)
  for row in range(4):
    for a, b in zip(sharded[row], single[row]):
      np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.parametrize("tempered", [False, True], ids=["raw", "tempered"])
def test_log_probs_equal_training_forward(tiny_config, tempered):
  cfg = gemma_like(tiny_config)  # sliding windows of 3 and soft-caps: the pages hold more than a window
  params = perturbed_params(cfg)
  sampling = SAMPLED
  engine = RolloutEngine(cfg, SMALL, sampling=sampling, seed=1, tempered_log_probs=tempered)
  got = run_requests(engine, params, range(len(PROMPTS)), [[]] * len(PROMPTS), samples=3)
  prompts, completions = zip(*[(PROMPTS[row], c) for row in range(len(PROMPTS)) for c in got[row]])
  width = max(len(p) + len(c.tokens) for p, c in zip(prompts, completions))
  tokens, positions, segments = right_padded(prompts, [c.tokens for c in completions], width)
  logits = forward_jit(params, tokens, cfg, positions=positions, segment_ids=segments)
  logits = logits / sampling.temperature if tempered else logits
  logp = np.asarray(token_log_probs(logits[:, :-1], tokens[:, 1:]))
  for row, (prompt, completion) in enumerate(zip(prompts, completions)):
    n = len(completion.tokens)
    assert n == BUDGETS[row // 3]  # no stop ids: every sample runs to its budget
    np.testing.assert_allclose(completion.log_probs, logp[row, len(prompt) - 1:len(prompt) - 1 + n],
                               atol=ENGINE_VS_TRAINER_ATOL, rtol=0)


def test_shared_prompt_pages_equal_copied_prompts_and_cost_one_prompt(tiny_config):
  cfg = gemma_like(tiny_config)
  # PROMPTS[4]: 39 cached prompt positions, 9 full pages of 4 shared, the 10th copied per sample.
  grouped, copied = grouped_equals_copied(cfg, SMALL, perturbed_params(cfg), G=4)
  # Each sample needs ceil((39 + 8) / 4) = 12 pages; a group shares the 9 full prompt pages: 12 + 3 * 3.
  assert grouped.allocator.peak_in_use == 12 + 3 * 3
  assert copied.allocator.peak_in_use == 4 * 12


def test_same_seed_and_order_give_the_same_tokens_whatever_the_shapes(tiny_config):
  cfg = gemma_like(tiny_config)
  params = perturbed_params(cfg)

  def tokens(config, seed):
    got = run_requests(RolloutEngine(cfg, config, sampling=SAMPLED, seed=seed), params, range(len(PROMPTS)),
                       [[]] * len(PROMPTS), samples=2)
    return [tuple(c.tokens) for row in range(len(PROMPTS)) for c in got[row]]

  other = EngineConfig(max_seqs=8, pages=17, page_size=16, max_seq_len=64, decode_steps=3, prefill_chunk=8,
                       prefill_rows=4)
  small = tokens(SMALL, 3)
  assert small == tokens(other, 3)
  assert small != tokens(SMALL, 4)


def test_extend_continues_a_held_sequence_as_one_prompt(tiny_config):
  """A multi-turn episode: turn 1 stops, a tool's output is appended without re-prefilling, turn 2 decodes on."""
  cfg = tiny_config
  params = perturbed_params(cfg)
  engine = RolloutEngine(cfg, SMALL, sampling=GREEDY)
  prompt, tool_output = PROMPTS[2], [7, 8, 9, 10, 11, 12]
  stop = greedy_tokens(params, cfg, prompt, 6)[3]
  (seq,) = engine.submit(prompt, max_new_tokens=6, stop_ids=[stop], keep=True)
  turn1 = engine.run(params)[seq]
  assert turn1.finish_reason == STOP and turn1.tokens[-1] == stop
  assert engine.allocator.in_use > 0 and not engine.busy  # held: its pages wait for the next turn
  engine.extend(seq, tool_output, max_new_tokens=7, stop_ids=[])
  turn2 = engine.run(params)[seq]
  whole = prompt + turn1.tokens.tolist() + tool_output
  np.testing.assert_array_equal(turn2.tokens, greedy_tokens(params, cfg, whole, 7))
  assert turn2.finish_reason == LENGTH
  engine.release(seq)
  assert engine.allocator.in_use == 0
  with pytest.raises(ValueError, match=f"sequence {seq}"):
    engine.extend(seq, [1], max_new_tokens=1)


def test_policy_versions_stamp_the_step_that_sampled_each_token(tiny_config):
  """A new version recomputes the cache: with the same parameters the tokens are those of one uninterrupted run."""
  cfg = tiny_config
  engine = RolloutEngine(cfg, SMALL, sampling=GREEDY)
  params = perturbed_params(cfg)
  (seq,) = engine.submit(PROMPTS[1], max_new_tokens=12)
  for version in range(10):
    for completion in engine.step(params, policy_version=version):
      done = completion
  assert done.policy_versions.tolist() == [0] * 5 + [1] * 5 + [2] * 2  # decode_steps = 5 tokens per call
  np.testing.assert_array_equal(done.tokens, greedy_tokens(params, cfg, PROMPTS[1], 12))


def test_an_update_continues_each_rollout_as_the_new_parameters_would(tiny_config):
  """After a version change every token comes from the new parameters given its whole context, held turns too."""
  cfg = tiny_config
  old, new = perturbed_params(cfg), perturbed_params(cfg, seed=3)
  engine = RolloutEngine(cfg, SMALL, sampling=GREEDY)
  (live,) = engine.submit(PROMPTS[4], max_new_tokens=12)
  (held,) = engine.submit(PROMPTS[1], max_new_tokens=4, keep=True)
  first = {c.seq_id: c for c in engine.step(old, policy_version=0)}  # 5 tokens of `live`; `held` finishes
  engine.extend(held, [7, 8, 9], max_new_tokens=6)
  done = engine.run(new, policy_version=1)
  turn1 = first[held].tokens.tolist()
  prefix = greedy_tokens(old, cfg, PROMPTS[4], 5)
  rest = greedy_tokens(new, cfg, PROMPTS[4] + prefix, 7)
  np.testing.assert_array_equal(done[live].tokens, prefix + rest)
  assert done[live].policy_versions.tolist() == [0] * 5 + [1] * 7
  np.testing.assert_array_equal(done[held].tokens, greedy_tokens(new, cfg, PROMPTS[1] + turn1 + [7, 8, 9], 6))


def test_a_restored_snapshot_goes_on_as_the_engine_would_have(tiny_config):
  """Sampled rollouts, saved mid-flight (queued, prefilled, part-decoded, grouped) and restored on a fresh engine."""
  cfg = gemma_like(tiny_config)  # the sampled programs of the tests above
  params = perturbed_params(cfg)

  def start():
    engine = RolloutEngine(cfg, SMALL, sampling=SAMPLED, seed=9)
    for row in range(6):
      engine.submit(PROMPTS[row], max_new_tokens=BUDGETS[row] + 4, samples=2)
    return engine

  whole = start()
  want = whole.run(params)
  engine = start()
  got = {c.seq_id: c for c in engine.step(params)}
  saved = jax.tree.map(np.asarray, engine.snapshot())
  assert saved["tokens_lengths"].max() > 0 and len(set(saved["group"].tolist())) < len(saved["group"])
  restored = RolloutEngine(cfg, SMALL, sampling=SAMPLED, seed=9)
  restored.restore(saved)
  got.update(restored.run(params))
  assert sorted(got) == sorted(want)
  for seq_id, c in want.items():
    np.testing.assert_array_equal(got[seq_id].tokens, c.tokens)
    # The restored engine prefilled the contexts in other calls: the same float32 math in another row layout.
    np.testing.assert_allclose(got[seq_id].log_probs, c.log_probs, atol=ENGINE_VS_TRAINER_ATOL)
  with pytest.raises(ValueError, match="empty engine"):
    restored.submit(PROMPTS[0], max_new_tokens=1)
    restored.restore(saved)


def test_the_latent_pages_decode_the_full_forwards_tokens_on_one_device_and_in_int8_on_a_mesh(tiny_config, mesh):
  cfg = mla_like(tiny_config)
  params = perturbed_params(cfg)
  want = argmax_reference(params, cfg, PROMPTS, N_NEW)  # the naive forward, re-run over each grown sequence
  exact = RolloutEngine(cfg, SMALL, sampling=GREEDY)
  got = run_requests(exact, params, range(len(PROMPTS)), [[]] * len(PROMPTS))
  for row, budget in enumerate(BUDGETS):
    np.testing.assert_array_equal(got[row][0].tokens, want[row, :budget], err_msg=f"request {row}")
  int8_config = dataclasses.replace(SMALL, kv_dtype="int8")
  int8 = RolloutEngine(cfg, int8_config, sampling=GREEDY, mesh=mesh)  # data 2 x tensor 4: one KV head, unsplit
  # Per slot and layer one latent of 12 + 4: 16 float32s, or 16 int8s and a scale, where expanded K/V would take
  # 8 heads x (14 + 6).
  slots = SMALL.pages * SMALL.page_size * cfg.n_layers
  assert exact.pool_bytes == slots * 16 * 4 and int8.pool_bytes == slots * (16 + 4)
  placed = jax.device_put(params, param_shardings(cfg, mesh))
  quantised = run_requests(int8, placed, range(len(PROMPTS)), [[]] * len(PROMPTS))
  same = compared = 0
  for row in range(len(PROMPTS)):
    (x,), (y,) = got[row], quantised[row]
    n = next((i for i, (s, t) in enumerate(zip(x.tokens, y.tokens)) if s != t), len(x.tokens))
    # As tests/sampling/test_int8_pages.py: int8 moves the log-probs of the same tokens by hundredths of a nat.
    np.testing.assert_allclose(y.log_probs[:n], x.log_probs[:n], atol=0.1, rtol=0, err_msg=f"request {row}")
    same, compared = same + n, compared + len(x.tokens)
  assert same >= 0.8 * compared, (same, compared)


def test_bad_requests_name_what_is_wrong(tiny_config):
  cfg = tiny_config
  engine = RolloutEngine(cfg, SMALL)
  with pytest.raises(ValueError, match="request 0.*empty"):
    engine.submit([], max_new_tokens=3)
  with pytest.raises(ValueError, match="token 999 at position 1 is outside the vocabulary"):
    engine.submit([1, 999], max_new_tokens=3)
  with pytest.raises(ValueError, match="needs 69 cached positions; EngineConfig.max_seq_len is 64"):
    engine.submit([1] * 10, max_new_tokens=60)
  with pytest.raises(ValueError, match="need 64 pages, more than the 63 of one device's block"):
    engine.submit([1], max_new_tokens=63, samples=4)
  with pytest.raises(ValueError, match="5 samples share pages on one device, which has 4 slots"):
    engine.submit([1], max_new_tokens=3, samples=5)
  with pytest.raises(ValueError, match="cannot extend sequence 0: it is not held"):
    engine.extend(0, [1], max_new_tokens=1)
  assert not engine.busy  # nothing was queued by the failed calls


def test_shapes_must_split_over_the_mesh(tiny_config, mesh):
  with pytest.raises(ValueError, match="max_seqs = 3 must be a multiple of the 2 devices"):
    RolloutEngine(tiny_config, dataclasses.replace(SMALL, max_seqs=3), mesh=mesh)


def test_on_demand_admission_preempts_and_still_equals_generate(tiny_config):
  check_on_demand_greedy(RolloutEngine(tiny_config, TIGHT, sampling=GREEDY), tiny_config)


def _sampled_groups(cfg, config, steps_before_snapshot=None):
  """Every SHORT prompt in groups of 2 at SAMPLED, seed 4: {seq_id: completion} (and the engine)."""
  params = perturbed_params(cfg)
  engine = RolloutEngine(cfg, config, sampling=SAMPLED, seed=4)
  for prompt in SHORT:
    engine.submit(prompt, max_new_tokens=LONG_BUDGET, samples=2)
  done = {}
  for _ in range(steps_before_snapshot or 0):
    done.update((c.seq_id, c) for c in engine.step(params))
  if steps_before_snapshot is None:
    done = engine.run(params)
  return done, engine


@functools.cache  # run once for the two tests below (read only)
def _on_demand_groups(cfg):
  """`_sampled_groups` on TIGHT: (completions, preemptions)."""
  done, engine = _sampled_groups(cfg, TIGHT)
  return done, engine.preemptions


def test_preempted_samples_draw_the_tokens_reserved_ones_do(tiny_config):
  """A preempted sample (a group's leader or follower) goes on with its RNG counter, as if never stopped."""
  cfg = tiny_config
  on_demand, preemptions = _on_demand_groups(cfg)
  # The same pool reserving each request's whole budget: groups wait for pages instead of being preempted.
  reserved, engine = _sampled_groups(cfg, dataclasses.replace(TIGHT, admission="reserve"))
  assert preemptions > 1 and engine.preemptions == 0
  assert sorted(on_demand) == sorted(reserved)
  for seq_id, want in reserved.items():
    np.testing.assert_array_equal(on_demand[seq_id].tokens, want.tokens, err_msg=f"sequence {seq_id}")
    # A preempted sample's context was prefilled again: the same float32 math in another program.
    np.testing.assert_allclose(on_demand[seq_id].log_probs, want.log_probs, atol=ENGINE_VS_TRAINER_ATOL)


def test_a_snapshot_with_preempted_sequences_restores_them(tiny_config):
  cfg = tiny_config
  want, _ = _on_demand_groups(cfg)
  got, engine = _sampled_groups(cfg, TIGHT, steps_before_snapshot=6)
  assert engine._admission.preempted, "the snapshot should catch preempted sequences"
  restored = RolloutEngine(cfg, TIGHT, sampling=SAMPLED, seed=4)
  restored.restore(jax.tree.map(np.asarray, engine.snapshot()))
  got.update(restored.run(perturbed_params(cfg)))
  assert sorted(got) == sorted(want)
  for seq_id, c in want.items():
    np.testing.assert_array_equal(got[seq_id].tokens, c.tokens, err_msg=f"sequence {seq_id}")
