"""Routing replay in GRPO's steps: the fused and host-reward modes replay the sampler's routes (R3), any mode the old
policy's (R2); a host pipeline holding routes resumes bitwise; the options a step cannot serve are refused. And the
expert-parallel update at a lowered capacity, whose dropped tokens leave the loss while the sampler drops none."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_steps import MODEL, build, even_tokens, even_tokens_on_host
from model_variants import moe_like
from stepping import run_steps
from ptx.config import ConfigError, GRPOConfig, MeshConfig
from ptx.config_rules import check_engine_rollouts
from ptx.sampling.rules import SamplingConfig
from ptx.train.grpo.update import RLSpec

_TINY_MOE = moe_like(MODEL, shared_mlp_dim=0)
MOE = dataclasses.replace(_TINY_MOE, moe=dataclasses.replace(_TINY_MOE.moe, n_experts=8))
SAMPLING = SamplingConfig(temperature=0.8)


def _grpo(replay, **kw):
  return GRPOConfig(group_size=2, beta=0.04, sampling=SAMPLING, routing_replay=replay, **kw)


@pytest.fixture(scope="module")
def fused_runs():
  """Two fused steps of the tiny MoE (float32) per replay mode: {mode: (state, metrics per step)}."""
  return {mode: build(MOE, _grpo(mode, max_staleness=0), even_tokens).run(2) for mode in ("none", "rollout")}


def test_replaying_a_float32_rollout_trains_as_routing_afresh(fused_runs):
  # In float32 the sampler and the update's forward pick the same experts (tests/models/test_routing_replay.py), so
  # replaying the sampler's routes changes no value: the same rewards, loss and parameters, up to the rounding of the
  # replay's few extra operations (1e-6 relative; Adam's eps from tolerances.py keeps it from growing).
  (none, none_metrics), (replay, replay_metrics) = fused_runs["none"], fused_runs["rollout"]
  for want, got in zip(none_metrics, replay_metrics):
    for key in ("reward/mean", "loss", "actor/kl_loss", "moe/load_max_over_mean"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert "moe/route_flips" not in want
    # The first update's forward at the sampling parameters takes every sampled route as its own: no flip, and
    # the sampler-trainer gap at float32 rounding.
    assert got["moe/route_flips"] == 0.0 and got["rollout/logp_diff_max"] < 1e-5
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), replay.params, none.params)


def test_old_policy_replay_holds_the_first_updates_routes_over_later_mini_batches():
  # R2: routes recorded by a forward at the step's parameters; two mini-batches, so the second update runs at
  # parameters one update on and replays routes it might no longer pick.
  _, history = build(MOE, _grpo("old_policy", max_staleness=0, minibatches=2), even_tokens).run(1)
  flips = history[0]["moe/route_flips"]
  assert 0.0 <= flips < 0.5 and np.isfinite(history[0]["loss"])
  print(f"old-policy replay, mean flips over 2 updates: {flips:.4f}")


def test_a_host_pipeline_holding_routes_resumes_exactly():
  # One batch sampled ahead (max_staleness 1): it waits in the pipeline with its routes; the checkpoint holds them
  # (int16 [R, P + N, L, k]) and a fresh step given them continues bitwise as the uninterrupted one.
  cfg = _grpo("rollout", max_staleness=1)
  run = build(MOE, cfg, even_tokens_on_host, kind="host")
  state, first = run.run(2)
  saved = {"state": jax.tree.map(jnp.copy, state), "pipeline": jax.tree.map(np.asarray, run.step.pipeline_state()),
           "position": run.data.get_state()}
  routes = saved["pipeline"]["batches"]["0"]["rollouts"]["routes"]
  assert routes.dtype == np.int16 and routes.shape[2:] == (MOE.n_layers, MOE.moe.experts_per_token)
  assert "routes" not in saved["pipeline"]["batches"]["0"]["gen"]  # held once, in the rows
  print(f"routes of a pending batch: {routes.nbytes} bytes ({routes.shape})")
  _, want = run.run(2)
  fresh = build(MOE, cfg, even_tokens_on_host, kind="host")
  fresh.data.set_state(saved["position"])
  fresh.step.set_pipeline_state(saved["pipeline"])
  state, got = run_steps(fresh.step, saved["state"], fresh.data, 2)
  drop = lambda m: {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}
  for step_want, step_got in zip(want, got):
    np.testing.assert_equal(drop(step_got), drop(step_want))
  assert all("moe/route_flips" in m for m in first + want)
  jax.tree.map(np.testing.assert_array_equal, state.params, run.state.params)


def test_a_lowered_capacity_drops_copies_in_the_update_but_never_in_the_sampler():
  # Capacity factor 1 splits 8 experts over data2 x expert4: the update's forward drops token copies (its
  # `moe/tokens_dropped`), the sampler, which decodes through the KV-cache forward, none; the predictions of the
  # dropping positions leave the loss, so the sampler-trainer gap over the tokens left stays at float32 rounding.
  # Remat keeps the update off the shared-prompt path, a KV-cache forward and so dropless too.
  model = dataclasses.replace(MOE, moe_impl="expert_parallel", moe_capacity_factor=1.0, remat="full")
  # No reference: its forward, at the same parameters, would drop the same copies and mask them before the loss.
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, sampling=SAMPLING, max_staleness=0)
  _, history = build(model, grpo_cfg, even_tokens, mesh_cfg=MeshConfig(data=2, fsdp=1, expert=4)).run(1)
  metrics = history[0]
  assert metrics["moe/tokens_dropped"] > 0.05, metrics["moe/tokens_dropped"]
  assert metrics["rollout/logp_diff_max"] < 1e-5 and np.isfinite(metrics["loss"])
  print(f"capacity factor 1: {metrics['moe/tokens_dropped']:.3f} of the update's copies dropped, sampler-trainer gap "
        f"{metrics['rollout/logp_diff_max']:.2e}")


def test_replay_options_a_run_cannot_serve_are_refused_by_name():
  with pytest.raises(ConfigError, match="grpo.routing_replay='rollout'.*model.moe.n_experts = 0"):
    RLSpec(model=MODEL, grpo=_grpo("rollout"), max_new_tokens=4, stop_ids=(1,))
  # The rollout engine records routes too (tests/train/grpo/test_engine_routing_replay.py); R2 needs nothing from it.
  check_engine_rollouts(_grpo("rollout", rollouts="engine"))
  check_engine_rollouts(_grpo("old_policy", rollouts="engine"))
