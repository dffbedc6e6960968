"""Routing replay (R3) over the rollout engine: GRPO's engine step and the episode step replay the routes the engine
recorded; in float32 no route flips, in int8 fast mode the update takes the sampler's; a pipeline holding routes
resumes as the uninterrupted run does."""

import dataclasses

import jax
import numpy as np
import pytest
from scripted_episodes import ScriptedEnv

from grpo_steps import MODEL, N_NEW, build, even_tokens_on_host, optimizer
from model_variants import moe_like
from stepping import run_steps
from ptx.config import GRPOConfig, MeshConfig, RolloutConfig
from ptx.data.tokenizer import ByteTokenizer
from ptx.episodes.turn_format import TurnFormat
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.mode import RolloutMode
from ptx.sampling.rules import SamplingConfig
from ptx.sharding import make_mesh
from ptx.models import moe
from ptx.train.grpo import episodes
from ptx.train.grpo.episode_rows import episode_rollouts
from ptx.train.grpo.episodes import EpisodeStep
from ptx.train.grpo.update import RLSpec
from ptx.train.state import init_state, state_shardings

_TINY_MOE = moe_like(MODEL, shared_mlp_dim=0)
MOE = dataclasses.replace(_TINY_MOE, moe=dataclasses.replace(_TINY_MOE.moe, n_experts=8))  # 1 MoE layer, 2 a token
# As tests/train/grpo/test_engine_step.py: prompts of at most 8 tokens, decode calls of 2 tokens, slots for 1.5
# batches (batch k + 1 waits for k's slots, so part of it decodes after k's update), one token in five a stop.
STALE = EngineConfig(max_seqs=24, pages=32 * 2 + 1, page_size=8, max_seq_len=8 + N_NEW, decode_steps=2,
                     prefill_chunk=8, prefill_rows=8)
STOPS = tuple(range(3, 264, 5))
STALE_GRPO = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", max_staleness=1,
                        sampling=SamplingConfig(temperature=1.5), routing_replay="rollout")


def _check_recorded(rows):
  """Every real token of the rows has routes but each row's last (never fed); padding has none."""
  real = np.asarray(rows["segment_ids"]) > 0
  last = np.zeros_like(real)
  last[np.arange(len(real)), real.shape[1] - 1 - np.argmax(real[:, ::-1], axis=1)] = True
  routes = np.asarray(rows["routes"])
  assert routes.dtype == np.int16 and routes.shape == real.shape + (MOE.n_moe_layers, 2)
  recorded = (routes >= 0).all(axis=(2, 3))
  np.testing.assert_array_equal(recorded, real & ~last)
  assert (routes[~recorded] == moe.NO_ROUTE).all()


@pytest.fixture(scope="module")
def stale_run():
  """3 steps of STALE_GRPO with routing replay; (the run, its metrics per step, a checkpoint after step 1)."""
  built = build(MOE, STALE_GRPO, even_tokens_on_host, kind="engine", engine=STALE, stop_ids=STOPS)
  assemble = built.step._assemble
  built.step._assemble = lambda b: _checked(assemble(b))
  _, first = built.run(1)
  saved = built.checkpoint()
  _, rest = built.run(2)
  return built, first + rest, saved


def _checked(assembled):
  _check_recorded(jax.device_get(assembled[0]))
  return assembled


def test_engine_rollouts_replay_their_recorded_routes_without_a_flip_in_float32(stale_run):
  built, history, _ = stale_run
  # Batch 0 was sampled under version 0 alone, and the first update's forward runs at those parameters: it takes
  # every recorded route as its own (the engine's calls and the training forward sum in other orders, ~1e-6, far
  # from a router tie), and its log-probs are the sampler's to rounding. A route in the wrong column would flip.
  assert history[0]["moe/route_flips"] == 0.0 and history[0]["rollout/logp_diff_max"] < 1e-4
  # Later batches hold tokens whose routes were recorded a version before the update that trains on them.
  for m in history[1:]:
    assert 0.0 <= m["moe/route_flips"] < 0.1 and np.isfinite(m["loss"])
  print("route flips per step:", [m["moe/route_flips"] for m in history])
  R, S = 8 * STALE_GRPO.group_size, 8 + N_NEW
  print(f"routes host to device: {R} x {S} x {MOE.n_moe_layers} x {MOE.moe.experts_per_token} x 2 = "
        f"{R * S * MOE.n_moe_layers * MOE.moe.experts_per_token * 2} bytes a step")


def test_a_pipeline_holding_routes_resumes_as_the_uninterrupted_run(stale_run):
  full, history, saved = stale_run
  batch = saved["pipeline"]["batches"]["0"]
  # The finished completions of the batch in flight keep their routes (int16, each one's context but its last
  # token); the unfinished sequences record theirs again when the restored engine prefills them.
  assert batch["routes"].dtype == np.int16 and batch["routes"].shape[1:] == (MOE.n_moe_layers, 2)
  assert len(batch["done"]) > 1 and batch["routes_lengths"][:-1].sum() == len(batch["routes"]) - 1
  resumed = build(MOE, STALE_GRPO, even_tokens_on_host, kind="engine", engine=STALE, stop_ids=STOPS)
  resumed.data.set_state(saved["position"])
  resumed.step.set_pipeline_state(saved["pipeline"])
  state, rest = run_steps(resumed.step, saved["state"], resumed.data, 2)
  for want, got in zip(history[1:], rest):
    for key in ("reward/mean", "response_length/mean", "rollout/staleness_mean", "moe/route_flips"):
      assert got[key] == want[key], key
    # As tests/train/grpo/test_engine_step.py: the restored engine prefills the saved contexts in other rows and
    # calls, so its log-probs round an ulp or so apart; a wrong token, route or version would move the loss more.
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6),
               state.params, full.state.params)


def test_fast_mode_replays_the_int8_samplers_routes():
  # On-policy, but int8 rollouts: the update recomputes the old log-probs with the float parameters, replaying the
  # int8 sampler's routes, which its router would sometimes not pick (`moe/route_flips`, the fraction of replayed
  # experts the live top-k leaves out).
  grpo_cfg = dataclasses.replace(STALE_GRPO, max_staleness=0, sampling=SamplingConfig(temperature=0.7))
  engine = dataclasses.replace(STALE, max_seqs=16)
  built = build(MOE, grpo_cfg, even_tokens_on_host, kind="engine", engine=engine, stop_ids=STOPS,
                mode=RolloutMode.of(RolloutConfig(mode="fast", verify_cost=1.0)))
  _, history = built.run(2)
  print("fast mode route flips per step:", [m["moe/route_flips"] for m in history])
  assert any(m["moe/route_flips"] > 0 for m in history), "no route flipped: the test shows nothing"
  for m in history:
    assert m["moe/route_flips"] < 0.2 and np.isfinite(m["loss"]) and 0.0 < m["rollout/logp_gap_abs"] < 0.5


def test_episode_steps_replay_every_tokens_routes_replies_included(monkeypatch):
  # Episodes as tests/train/grpo/test_episode_step.py plays them, of 1 or 2 turns (a reply is ~76 bytes), of the tiny
  # MoE: replies are prefilled, so they carry routes too; an episode's last token, never fed, has none.
  context, n = 160, 96  # the first prompt gets 64 columns (a formatted prompt is ~55 tokens)
  engine = EngineConfig(max_seqs=8, pages=8 * (context // 8) + 1, page_size=8, max_seq_len=context, decode_steps=4,
                        prefill_chunk=32, prefill_rows=2)
  mesh = make_mesh(MeshConfig(data=2, fsdp=2), devices=jax.devices()[:4])
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", routing_replay="rollout")
  opt = optimizer(grpo_cfg)
  state = init_state(MOE, opt, 0, mesh)
  spec = RLSpec(model=MOE, grpo=grpo_cfg, max_new_tokens=n, stop_ids=(2,), pad_id=0)
  step = EpisodeStep(spec=spec, optimizer=opt, mesh=mesh, state_shardings=state_shardings(MOE, opt, mesh),
                     env=ScriptedEnv(reward=lambda actions: float(len(actions[-1]) % 2)),
                     fmt=TurnFormat(ByteTokenizer()), engine=engine, max_turn_tokens=5)
  tasks = iter([{"task": [{"prompt": f"ok {i}", "turns": 1 + i % 2} for i in range(4)]}])
  laid_out = []

  def keeping(*args, **kwargs):
    laid_out.append(episode_rollouts(*args, **kwargs))
    return laid_out[-1]

  monkeypatch.setattr(episodes, "episode_rollouts", keeping)
  _, (m,) = run_steps(step, state, tasks, 1)
  _check_recorded(laid_out[0][0])
  # On-policy in float32: the update's forward takes every recorded route (prompt, turns and replies) as its own.
  assert m["moe/route_flips"] == 0.0 and m["rollout/logp_diff_max"] < 1e-4
  assert m["episodes/tokens_environment_mean"] > 0 and np.isfinite(m["loss"])
