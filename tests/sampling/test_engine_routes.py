"""The rollout engine's recorded routes (routing replay): each token's experts as a full forward picks them, through
shared prompt pages, preemption, extend, snapshot and speculative verify; in fast mode, the int8 sampler's own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_setup import ALWAYS, GREEDY, LONG_BUDGET, SAMPLED, SHORT, SMALL, TIGHT, perturbed_params

from model_variants import moe_like
from scripted_episodes import MODEL
from ptx.models.decoder import hidden_states
from ptx.models.rollout_params import rollout_params
from ptx.sampling.engine.drafters import NgramDrafter
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.speculative import SpeculativeEngine

CFG = moe_like(MODEL, shared_mlp_dim=0)  # 3 MoE layers of 6 experts, 2 a token
WIDTH = TIGHT.max_seq_len  # every context fits: one compiled full forward per parameter tree


@functools.cache
def _full_forward(int8: bool):
  """The training forward's routes of right-padded rows [B, WIDTH], over the float or the int8 rollout tree."""

  def routes(params, tokens, segment_ids):
    params = rollout_params(params, CFG) if int8 else params
    positions = jnp.broadcast_to(jnp.arange(WIDTH, dtype=jnp.int32), tokens.shape)
    return hidden_states(params, tokens, CFG, positions=positions, segment_ids=segment_ids)[1].routes

  return jax.jit(routes)


def _differ(params, contexts, completions, int8=False):
  """Per completion, whether each (token, layer)'s recorded experts differ from the full forward's over its context
  (the tokens its cache holds: `contexts[i]`, then its turn but the last token); asserts the shapes line up."""
  rows = [list(ctx) + c.tokens.tolist()[:-1] for ctx, c in zip(contexts, completions)]
  tokens, segments = np.zeros((len(rows), WIDTH), np.int32), np.zeros((len(rows), WIDTH), np.int32)
  for r, row in enumerate(rows):
    tokens[r, :len(row)], segments[r, :len(row)] = row, 1
  full = np.sort(np.asarray(_full_forward(int8)(params, tokens, segments)), -1)
  out = []
  for r, (row, c) in enumerate(zip(rows, completions)):
    assert c.routes.dtype == np.int16 and c.routes.shape == (len(row), CFG.n_moe_layers, 2), (c.routes.shape, r)
    out.append((np.sort(c.routes, -1) != full[r, :len(row)]).any(-1))
  return out


def _groups(config, snapshot_after=None):
  """Every SHORT prompt in groups of 2 at SAMPLED, recording routes: ({seq_id: completion}, {seq_id: prompt}, the
  engine); with `snapshot_after`, that many steps, then the rest on a fresh engine restored from a snapshot."""
  params = perturbed_params(CFG)
  engine = RolloutEngine(CFG, config, sampling=SAMPLED, seed=4, record_routes=True)
  prompts = {seq_id: prompt for prompt in SHORT
             for seq_id in engine.submit(prompt, max_new_tokens=LONG_BUDGET, samples=2)}
  if snapshot_after is None:
    return engine.run(params), prompts, engine
  done = {}
  for _ in range(snapshot_after):
    done.update((c.seq_id, c) for c in engine.step(params))
  restored = RolloutEngine(CFG, config, sampling=SAMPLED, seed=4, record_routes=True)
  restored.restore(jax.tree.map(np.asarray, engine.snapshot()))
  done.update(restored.run(params))
  return done, prompts, engine


def _check_full_forward(params, done, prompts):
  """Every completion's routes equal the full forward's over its context, in float32."""
  ids = sorted(done)
  # float32: the engine's calls (prefill chunks, one token a decode step) and the full forward sum in other orders,
  # ~1e-6 apart; no router score here is that near a tie (a misplaced token or column would differ by whole experts).
  differ = _differ(params, [prompts[i] for i in ids], [done[i] for i in ids])
  assert not any(d.any() for d in differ), [i for i, d in zip(ids, differ) if d.any()]


def test_recorded_routes_are_the_full_forwards_through_shared_prompts_and_preemption():
  done, prompts, engine = _groups(TIGHT)
  # Followers read their leader's prompt pages (and routes); preempted sequences were prefilled again.
  assert engine.preemptions > 1 and len(done) == 2 * len(SHORT)
  _check_full_forward(perturbed_params(CFG), done, prompts)


def test_a_restored_snapshot_records_its_contexts_routes_again():
  done, prompts, engine = _groups(TIGHT, snapshot_after=6)
  assert engine._admission.preempted, "the snapshot should catch preempted sequences"
  _check_full_forward(perturbed_params(CFG), done, prompts)


def test_an_extended_turn_records_the_whole_context_the_reply_included():
  params = perturbed_params(CFG)
  engine = RolloutEngine(CFG, TIGHT, sampling=SAMPLED, seed=5, record_routes=True)
  (seq,) = engine.submit(SHORT[2], max_new_tokens=6, keep=True)
  (first,) = engine.run(params).values()
  reply = [7, 8, 9, 10]
  engine.extend(seq, reply, max_new_tokens=5)
  (second,) = engine.run(params).values()
  engine.release(seq)
  # The second turn's context: prompt, first turn, reply; its routes cover all of it and the turn but its last token.
  context = SHORT[2] + first.tokens.tolist() + reply
  assert not _differ(params, [SHORT[2], context], [first, second])[1].any()
  np.testing.assert_array_equal(second.routes[:len(first.routes)], first.routes)  # the same cache, unwritten


class _RepeatDrafter:
  """A host drafter: the tokens that followed the last token's previous occurrence (greedy rollouts loop)."""

  def propose(self, context, k):
    last = len(context) - 1
    before = [i for i in range(last) if context[i] == context[last]]
    return list(context[before[-1] + 1:before[-1] + 1 + k]) if before else []


def test_speculative_verify_records_the_fed_tokens_routes_with_a_host_drafter():
  params = perturbed_params(CFG)
  engine = SpeculativeEngine(CFG, SMALL, drafter=_RepeatDrafter(), speculative=ALWAYS, sampling=GREEDY,
                             record_routes=True)
  prompts = {engine.submit(prompt, max_new_tokens=LONG_BUDGET)[0]: prompt for prompt in SHORT[:4]}
  done = engine.run(params)
  assert sum(c.accepted for c in done.values()) > 0  # accepted drafts' routes come from the verify forward
  _check_full_forward(params, done, prompts)


def test_fast_mode_records_the_int8_samplers_routes_which_the_float_forward_would_flip():
  params = perturbed_params(CFG)
  engine = SpeculativeEngine(CFG, SMALL, drafter=NgramDrafter(), speculative=ALWAYS, sampling=GREEDY,
                             record_routes=True)
  prompts = {engine.submit(prompt, max_new_tokens=LONG_BUDGET)[0]: prompt for prompt in SHORT[:4]}
  done = engine.run(jax.jit(rollout_params, static_argnames="cfg")(params, cfg=CFG))
  assert sum(c.accepted for c in done.values()) > 0
  ids = sorted(done)
  contexts, completions = [prompts[i] for i in ids], [done[i] for i in ids]
  # The int8 tree's full forward picks what the int8 sampler recorded (the same float32 rounding as above) ...
  assert not any(d.any() for d in _differ(params, contexts, completions, int8=True))
  # ... and the float forward, which the update runs, picks otherwise for some (token, layer): what replay fixes.
  flipped = np.concatenate([d.reshape(-1) for d in _differ(params, contexts, completions)])
  print(f"int8 sampler vs float forward: {flipped.sum()} of {flipped.size} (token, layer) routes differ "
        f"({flipped.mean():.2%})")
  assert flipped.any(), "no route flipped: the test shows nothing"


def test_recording_needs_experts(tiny_config):
  with pytest.raises(ValueError, match="record_routes needs a Mixture-of-Experts"):
    RolloutEngine(tiny_config, SMALL, record_routes=True)
