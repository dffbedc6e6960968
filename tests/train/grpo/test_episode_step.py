"""GRPO over multi-turn episodes: steps play and train on-policy, the learner sees what was sampled, metrics count,
transcripts show the episodes."""

import dataclasses
import json

import jax
import numpy as np
from scripted_episodes import ScriptedEnv

from stepping import run_steps
from tolerances import ADAM_EPS
from ptx.config import GRPOConfig, MeshConfig, OptimizerConfig
from ptx.data.tokenizer import ByteTokenizer
from ptx.episodes.turn_format import TurnFormat
from ptx.sampling.engine.config import EngineConfig
from ptx.sharding import make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.grpo.episodes import EpisodeStep
from ptx.train.grpo.update import RLSpec
from ptx.train.state import init_state, state_shardings

CONTEXT, N = 264, 200  # the first prompt gets the 64 columns before the episode's 200 (a reply is ~76 bytes)
# One prefill row per device block: every prefill call has one shape but for the pages it reads (4 variants compiled
# instead of 5).
ENGINE = EngineConfig(max_seqs=8, pages=8 * (CONTEXT // 8) + 1, page_size=8, max_seq_len=CONTEXT, decode_steps=4,
                      prefill_chunk=32, prefill_rows=2)


def _tasks():
  """Batches of 4 tasks of 1-3 turns; prompts 'bad ...' make their tool fail."""
  for step in range(100):
    yield {"task": [{"prompt": f"{'bad' if i == 3 else 'ok'} {step}.{i}", "turns": 1 + i % 3} for i in range(4)]}


def test_steps_play_episodes_and_train_on_exactly_what_was_sampled(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  # Batch over both axes, parameters sharded over fsdp: the layout of (data=2, fsdp=4) on half the fake devices,
  # which on 2 cores compile and run a fifth faster and keep their threads when the machine is loaded.
  mesh = make_mesh(MeshConfig(data=2, fsdp=2), devices=jax.devices()[:4])
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none")
  optimizer = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0, eps=ADAM_EPS), 10)
  state = init_state(cfg, optimizer, 0, mesh)
  before = jax.device_get(state.params)
  env = ScriptedEnv(fail="bad", reward=lambda actions: float(len(actions[-1]) % 2))
  spec = RLSpec(model=cfg, grpo=grpo_cfg, max_new_tokens=N, stop_ids=(2,), pad_id=0)
  step = EpisodeStep(spec=spec, optimizer=optimizer, mesh=mesh, state_shardings=state_shardings(cfg, optimizer, mesh),
                     env=env, fmt=TurnFormat(ByteTokenizer()), engine=ENGINE, max_turn_tokens=5)
  state, history = run_steps(step, state, _tasks(), 2)
  assert int(state.step) == 2
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), jax.device_get(state.params), before)
  assert max(jax.tree.leaves(moved)) > 0
  for m in history:
    # The engine's log-probs against the update's forward over the laid-out rows, both float32 at the sampling
    # parameters: a misplaced token, reply or position would be O(1); the two programs round ~1e-6 apart.
    assert m["rollout/logp_diff_max"] < 1e-4 and np.isfinite(m["loss"])
    assert m["episodes/infra_error_frac"] == 0.25  # one task in four, both its samples
    assert m["episodes/outcome/infra_error"] == 0.25 and m["episodes/outcome/ok"] == 0.75
    # Turns: tasks of 1, 2 and 3 turns, and the failing task's single (raising) turn.
    assert m["episodes/turns_mean"] == (1 + 2 + 3 + 1) / 4
    # A call per observation (none in a final turn), the second of an episode failing: 0 + 1 + 2 + 0, 0 + 0 + 1 + 0.
    assert m["episodes/tool_calls_mean"] == 3 / 4 and m["episodes/tool_errors_mean"] == 1 / 4
    assert m["episodes/tokens_model_mean"] > 0 and m["episodes/tokens_environment_mean"] > 0
    assert m["timing_s/play"] > 0
  _check_transcripts(step.take_samples(wait=True))


def _check_transcripts(taken):
  """Step 1's transcript (`grpo.samples_every` 10: the first step, then every tenth): its 8 episodes, turn by turn."""
  assert sorted(taken) == [1]
  records = [json.loads(line) for line in taken[1].decode().splitlines()]
  assert [(r["step"], r["row"], r["group"], r["sample"]) for r in records] == [(1, r, r // 2, r % 2) for r in range(8)]
  for r in records:
    i = r["group"]
    messages, turns = r["messages"], (1 + i % 3 if i < 3 else 1)
    assert messages[0] == {"role": "user", "content": f"{'bad' if i == 3 else 'ok'} 0.{i}"}
    # The model's turns (its commands), each but the last answered by the tool's observation (its outcome).
    assert [m["role"] for m in messages[1:]] == ["assistant", "tool"] * (turns - 1) + ["assistant"]
    assert [m["content"] for m in messages[2::2]] == [f"obs {n} of ok 0.{i}" for n in range(1, turns)]
    assert r["turns"] == turns and r["tool_calls"] == turns - 1 and r["tool_errors"] == int(turns == 3)
    if i == 3:  # the tool's machine failed: no reward, not the model's doing
      assert r["outcome"] == "infra_error" and r["reward"] is None and r["end_reason"]
    else:  # the scripted reward of the last command
      assert r["outcome"] == "ok" and r["end_reason"] == "scripted"
      assert r["reward"] == float(len(messages[-1]["content"]) % 2)

