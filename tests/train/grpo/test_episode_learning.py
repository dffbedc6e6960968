"""Multi-turn GRPO learns to use a tool (#26's acceptance): a tiny model's held-out calculator accuracy rises.

The model is the 2-layer tiny preset over bytes, from random weights. Its SFT warm-up is DEMOS solved episodes of
train-split problems, half of them played through the calculator (`CalculatorEnv.demonstration`: the problem, a
call, the tool's result, `Answer: N`) and half answered at once with the right number, as a model that trusts its
mental arithmetic would. It cannot multiply a 4-digit number by a 3-digit one, so the direct answers are wrong
(a test asserts that none is ever right) and only the calculator's result copied back scores. After the warm-up it
calls the tool in about half of its episodes and copies a few numbers right; multi-turn GRPO
(`ptx.train.grpo.episodes.EpisodeStep`) on other train-split problems must then raise held-out accuracy and the
share of episodes that call the tool (and the accuracy of those episodes, which is printed).

The problems are `CalculatorTasks`' (their numbers and answers, split by identity), posed as the bare arithmetic
("What is 6405 * 560 + 3428?") instead of the word problem, all of one shape (4-digit * 3-digit +- 4-digit, a
7-digit answer), and calls are in the gemma format (the shortest). A 2-layer byte model learns to copy numbers from
a prompt into a call, and from a result into an answer, all at once after 200-400 SFT steps (by seed); numbers of one
length keep each copy at one distance, and a word problem would take it much longer. Held-out problems are played
with `play` on one fixed engine seed before and after.
"""

import functools

import jax
import numpy as np
import pytest

from ptx.algorithms import sft
from ptx.config import MODEL_PRESETS, GRPOConfig, MeshConfig, OptimizerConfig
from ptx.data.batch import pack_rows
from ptx.data.tokenizer import ByteTokenizer
from ptx.envs.calculator import CalculatorEnv, CalculatorTasks
from ptx.episodes.loop import play
from ptx.episodes.turn_format import TurnFormat
from ptx.sampling import SamplingConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig
from ptx.sharding import DEFAULT_RULES, make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.grpo.episodes import EpisodeStep
from ptx.train.grpo.update import RLSpec
from ptx.train.state import init_state, state_shardings
from ptx.train.step import make_train_step

TOK = ByteTokenizer()
FMT = TurnFormat(TOK)  # ChatML; a turn ends at eos, and the reply writes the end-of-turn marker
ENV = CalculatorEnv(max_turns=2, instructions=False, tool_format="gemma")
SEED = 2  # seed 0's warm-up learns to copy on some machines only (see the observed figures in the test)
# Byte tokens: a first prompt is at most 77, a solved episode adds at most 144 after it.
PROMPT, WIDTH, TURN = 80, 176, 72
SFT_STEPS, SFT_BATCH, DEMOS = 450, 16, 256
RL_STEPS, RL_TASKS, GROUP = 12, 8, 8
HELD_OUT = 64  # one episode each: as many as one GRPO step plays, so scoring reuses its engine's programs
SAMPLING = SamplingConfig(temperature=1.0)
GRPO = GRPOConfig(group_size=GROUP, beta=0.0, kl_placement="none", max_response_tokens=WIDTH, sampling=SAMPLING)
ENGINE = EngineConfig(max_seqs=RL_TASKS * GROUP, pages=RL_TASKS * GROUP * (PROMPT + WIDTH) // 16 + 1, page_size=16,
                      max_seq_len=PROMPT + WIDTH, decode_steps=16, prefill_chunk=64, prefill_rows=8)


def _problems(split, start, n):
  """Problems start..start+n-1 of a split of one shape (a 4-digit * 3-digit +- 4-digit = 7 digits), as arithmetic."""
  tasks, shaped, i = CalculatorTasks(SEED, split=split), [], 0
  while len(shaped) < start + n:
    task, i = tasks[i], i + 1
    if len(task["expression"]) == 17 and len(str(task["answer"])) == 7:
      shaped.append({**task, "prompt": f"What is {task['expression']}?"})
  return shaped[start:]


def _trained():
  """The train-split problems the model learns from: DEMOS demonstrated, then RL_STEPS batches played."""
  return _problems("train", 0, DEMOS), [_problems("train", DEMOS + k * RL_TASKS, RL_TASKS) for k in range(RL_STEPS)]


def _demonstration(task, direct):
  """A solved episode as its tokens (the model's turns are the targets): through the calculator, or `direct`."""
  messages = ENV.demonstration(task)
  if direct:
    messages = [messages[0], {"role": "assistant", "content": f"Answer: {task['answer']}"}]
  tokens = FMT.prompt(messages[0]["content"])
  mask = [0] * len(tokens)
  for i, message in enumerate(messages[1:], 1):
    if message["role"] == "assistant":
      turn = TOK.encode(message["content"]) + [FMT.stop_ids[0]]
    else:  # the reply exactly as `play` appends it
      turn = FMT.reply(messages[:i], message["content"], closed=True)
    tokens += turn
    mask += [int(message["role"] == "assistant")] * len(turn)
  return {"tokens": np.asarray(tokens, np.int32), "loss_mask": np.asarray(mask, np.int32)}


def warm_up(cfg, mesh, demos):
  """SFT from random weights on the demonstrations, half of them direct answers; returns the parameters."""
  optimizer = make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=10, min_lr_ratio=1.0, weight_decay=0.01),
                             SFT_STEPS)
  state = init_state(cfg, optimizer, SEED, mesh)
  step = make_train_step(functools.partial(sft.loss, model=cfg), optimizer, mesh=mesh,
                         state_shardings=state_shardings(cfg, optimizer, mesh))
  rng = np.random.default_rng(SEED)
  examples = [_demonstration(task, direct) for task, direct in zip(demos, rng.random(len(demos)) < 0.5)]
  for _ in range(SFT_STEPS):
    rows = [[examples[i]] for i in rng.choice(len(examples), SFT_BATCH, replace=False)]
    state, _ = step(state, pack_rows(rows, PROMPT + WIDTH, TOK.pad_id))
  return state.params


def score(cfg, params, mesh, tasks):
  """Held-out play on one engine seed: accuracy, the share of episodes that call the tool, and their accuracy."""
  engine = RolloutEngine(cfg, ENGINE.on_mesh(mesh, DEFAULT_RULES), sampling=SAMPLING, seed=7, mesh=mesh,
                         tempered_log_probs=True, pad_id=TOK.pad_id)
  episodes = play(engine, params, ENV, tasks, FMT, max_turn_tokens=TURN, max_episode_tokens=WIDTH)
  called = [t.reward for t in episodes if t.tool_calls]
  return {"accuracy": float(np.mean([t.reward for t in episodes])), "calls": len(called) / len(episodes),
          "accuracy_of_calls": float(np.mean(called)) if called else 0.0,
          "direct_right": sum(t.reward for t in episodes if not t.tool_calls)}


def train_grpo(cfg, params, mesh, batches):
  """Multi-turn GRPO over calculator episodes, a step per batch of problems; returns the parameters."""
  # 5e-4: at 1e-3 one machine's run (seed 2) overshot; see the observed figures in the test below.
  optimizer = make_optimizer(OptimizerConfig(lr=5e-4, warmup_steps=0, min_lr_ratio=1.0), len(batches))
  state = init_state(cfg, optimizer, SEED, mesh, params=params)
  spec = RLSpec(model=cfg, grpo=GRPO, max_new_tokens=WIDTH, stop_ids=FMT.stop_ids, pad_id=TOK.pad_id)
  step = EpisodeStep(spec=spec, optimizer=optimizer, mesh=mesh, state_shardings=state_shardings(cfg, optimizer, mesh),
                     env=ENV, fmt=FMT, engine=ENGINE, max_turn_tokens=TURN)
  for batch in batches:
    state, _ = step(state, {"task": batch})
  return state.params


def test_the_scored_problems_are_never_trained_on():
  demos, batches = _trained()
  trained = {t["prompt"] for t in demos} | {t["prompt"] for batch in batches for t in batch}
  scored = {t["prompt"] for t in _problems("held_out", 0, HELD_OUT)}
  assert len(scored) == HELD_OUT and len(trained) == DEMOS + RL_STEPS * RL_TASKS
  assert not trained & scored


@pytest.mark.slow
def test_multi_turn_grpo_raises_held_out_accuracy_and_tool_use():
  cfg = MODEL_PRESETS["tiny"]()
  mesh = make_mesh(MeshConfig(data=2, fsdp=1), devices=jax.devices()[:2])  # 2 cores: 2 devices are the fastest
  demos, batches = _trained()
  held_out = _problems("held_out", 0, HELD_OUT)
  params = warm_up(cfg, mesh, demos)
  before = score(cfg, params, mesh, held_out)
  after = score(cfg, train_grpo(cfg, params, mesh, batches), mesh, held_out)
  print(f"held-out, {HELD_OUT} problems: after SFT {before}\nafter {RL_STEPS} GRPO steps {after}")
  # Observed (accuracy, calls, accuracy of calls), after SFT -> after GRPO, GRPO at lr 1e-3 up to 12-04 noon: seed 0
  # (0.59, 0.62, 0.95) -> (0.91, 1.0, 0.91); seed 2 (0.47, 0.55, 0.86) -> (0.88, 0.95, 0.92); seed 1 after 500 SFT
  # steps (0.016, 0.17, 0.09) -> (0.36, 0.98, 0.37); seed 0 on all shapes after 300 (0.078, 0.56, 0.14) -> (0.53, 0.83,
  # 0.64). On 12-04's AMX Xeon, seed 0's SFT had not learned to copy by step 450 (0.0, 0.59, 0.0; by step 1,200 only
  # 0.125), while seed 2's SFT reached the same point as before (0.47, 0.56, 0.83); there GRPO at lr 1e-3 lowered it
  # to 0.39 (gradient-norm spikes of 3.6, half the episodes of one step at the token cap) and at lr 5e-4 (this test)
  # raised it to (0.89, 0.98, 0.90). Where
  # SFT leaves the model (how well it copies) varies with the step at which copying appears, so the assertions are on
  # GRPO's gains, below the smallest seen over seeds: another machine's float reduction order changes the sampled
  # tokens from some step on, as another seed does.
  # Half the demonstrations answer at once, so SFT leaves the model calling in about half its episodes.
  assert before["calls"] < 0.8 and before["accuracy"] < 0.7, f"SFT left the model at {before}: little to show"
  assert after["accuracy"] > before["accuracy"] + 0.2
  # It learns to call the tool on the problems it cannot do alone.
  assert after["calls"] > before["calls"] + 0.1
  # An answer without the calculator is never right, so every point gained is a call.
  assert before["direct_right"] == after["direct_right"] == 0
