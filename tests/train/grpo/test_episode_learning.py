"""Multi-turn GRPO learns to use a tool (#26's acceptance): a tiny model's held-out calculator accuracy rises.

The model is the 2-layer tiny preset narrowed to d_model 64 over bytes (vocab 264), from random weights. Its SFT
warm-up draws from DEMOS solved episodes of train-split problems, half of them played through the calculator
(`CalculatorEnv.demonstration`: the problem, a call, the tool's result, `Answer: N`) and half answered at once with
the right number, as a model that trusts its mental arithmetic would. It cannot multiply a 4-digit number by a 3-digit
one, so the direct answers are wrong (a test asserts that none is ever right) and only the calculator's result copied
back scores. The warm-up runs until the model copies: from the problem into its call, from the result into its answer
(the SFT loss then falls from ~0.65 to below COPIES). The model then calls the tool in about half of its episodes and
copies some numbers right; multi-turn GRPO (`ptx.train.grpo.episodes.EpisodeStep`) on other train-split problems must
raise held-out accuracy and the share of episodes that call the tool (and the accuracy of those, which is printed).

The problems are `CalculatorTasks`' (their numbers and answers, split by identity), posed as the bare arithmetic
("What is 6405 * 560 + 3428?") instead of the word problem, all of one shape (4-digit * 3-digit +- 4-digit, a
7-digit answer), and calls are in the gemma format (the shortest). Episodes are written in a chat layout of few bytes
(`Terse`), about half of ChatML's, so the learner's rows and the engine's pages are short. A 2-layer byte model learns
to copy numbers from a prompt into a call, and from a result into an answer, all at once after a few hundred SFT steps
(200-800 by seed and width); numbers of one length keep each copy at one distance, and a word problem would take it
much longer. Held-out problems are played with `play` on one fixed engine seed before and after.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from ptx.algorithms import sft
from ptx.config import GRPOConfig, MeshConfig, OptimizerConfig
from ptx.model_config import MODEL_PRESETS
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


@dataclasses.dataclass(frozen=True)
class Terse:
  """A chat template of few bytes: "u:" and "t:" lines for the user's and the tool's messages, ">" before each model
  turn; a turn has no end marker of its own, so it ends at eos (`TurnFormat.stop_ids`)."""

  add_bos: bool = True

  def segments(self, messages, add_generation_prompt=False):
    """The conversation as (text, is_target) segments: the model's turns are the targets."""
    out = []
    for m in messages:
      out += [(">", False), (m["content"], True)] if m["role"] == "assistant" else [
          (f"{m['role'][0]}:{m['content']}\n", False)]
    return out + [(">", False)] * add_generation_prompt


TOK = ByteTokenizer()
FMT = TurnFormat(TOK, Terse())
ENV = CalculatorEnv(max_turns=2, instructions=False, tool_format="gemma")
# The 2-layer tiny preset at a quarter of its width: its SFT steps cost about a third, and it learns to copy in as many.
MODEL = dataclasses.replace(MODEL_PRESETS["tiny"](), d_model=64, mlp_dim=192, head_dim=16, vocab_size=264)
SEED = 0  # by seed and machine the copying appears after 200-800 SFT steps: seed 0's after 210-340, seed 2's after 480
# Byte tokens: a first prompt is 31, a solved episode adds at most 87 after it (a call is 58).
PROMPT, WIDTH, TURN = 32, 128, 64
SFT_STEPS, SFT_BATCH, DEMOS = 1_000, 8, 256  # SFT_STEPS: at most; the warm-up stops once the model copies
# Mean SFT loss (of the last 20 steps) below which the model copies both numbers. Without copying it stays near 0.65
# (the digits of the call's expression and of the answer are guesses); copying both leaves the direct answers' digits
# (about 0.15), and the first of two copies learned leaves 0.4.
COPIES = 0.2
RL_STEPS, RL_TASKS, GROUP = 16, 8, 8
HELD_OUT = 64  # one episode each: as many as one GRPO step plays, so scoring reuses its engine's programs
SAMPLING = SamplingConfig(temperature=1.0)
GRPO = GRPOConfig(group_size=GROUP, beta=0.0, kl_placement="none", max_response_tokens=WIDTH, sampling=SAMPLING)
# Few shapes, so few programs to compile (compiling is most of this test's time): a decode call runs a whole turn, a
# prefill call takes one row per device block, and a sequence spans at most 3 pages of 64.
ENGINE = EngineConfig.sized(RL_TASKS * GROUP, PROMPT + WIDTH, page_size=64, decode_steps=TURN, prefill_chunk=32,
                            prefill_rows=2)


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
  """SFT from random weights on the demonstrations, the second half as direct answers, until the model copies.

  Returns:
    (the parameters, the SFT steps taken).
  """
  optimizer = make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=10, min_lr_ratio=1.0, weight_decay=0.01),
                             SFT_STEPS)
  state = init_state(cfg, optimizer, SEED, mesh)
  step = make_train_step(functools.partial(sft.loss, model=cfg), optimizer, mesh=mesh,
                         state_shardings=state_shardings(cfg, optimizer, mesh))
  rng = np.random.default_rng(SEED)
  half = len(demos) // 2
  calls, directs = [_demonstration(t, False) for t in demos[:half]], [_demonstration(t, True) for t in demos[half:]]
  losses = []
  for k in range(1, SFT_STEPS + 1):
    # Half of every batch calls and half answers at once: with the halves drawn at random, the odds of a call swung
    # from step to step (0.03 to 0.75 of held-out episodes), and at 0.03 GRPO has no calls to reinforce.
    rows = [[group[i]] for group in (calls, directs) for i in rng.choice(half, SFT_BATCH // 2, replace=False)]
    state, metrics = step(state, pack_rows(rows, PROMPT + WIDTH, TOK.pad_id))
    losses.append(metrics["loss"])
    if k % 10 == 0 and k >= 20 and np.mean(jax.device_get(losses[-20:])) < COPIES:  # read in tens: no sync a step
      return state.params, k
  pytest.fail(f"SFT did not teach the model to copy in {SFT_STEPS} steps: the loss of the last 20 steps is "
              f"{np.mean(jax.device_get(losses[-20:])):.3f}, not below {COPIES}")


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
  # 5e-4 (at 1e-3 one machine's run of the wider model overshot) after 4 warmup steps: Adam's first steps move every
  # weight by about lr, and at 5e-4 from the first step seed 2's model stopped calling the tool, or answering, by
  # step 3.
  optimizer = make_optimizer(OptimizerConfig(lr=5e-4, warmup_steps=4, min_lr_ratio=1.0), len(batches))
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
  mesh = make_mesh(MeshConfig(data=2, fsdp=1), devices=jax.devices()[:2])  # 2 cores: 2 devices are the fastest
  demos, batches = _trained()
  held_out = _problems("held_out", 0, HELD_OUT)
  params, sft_steps = warm_up(MODEL, mesh, demos)
  before = score(MODEL, params, mesh, held_out)
  after = score(MODEL, train_grpo(MODEL, params, mesh, batches), mesh, held_out)
  print(f"held-out, {HELD_OUT} problems: after {sft_steps} SFT steps {before}\nafter {RL_STEPS} GRPO steps {after}")
  # Observed (accuracy, calls, accuracy of calls), after SFT -> after GRPO: seed 0 (after 210 SFT steps)
  # (0.11, 0.52, 0.21) -> (0.55, 0.94, 0.58), and in another run (after 340) (0.20, 0.38, 0.54) -> (0.92, 1.0, 0.92);
  # seed 2 (after 480) (0.23, 0.61, 0.39) -> (0.44, 0.95, 0.46). With the
  # tiny preset at full width in ChatML (before 12-06): seed 2 (0.47, 0.55, 0.86) -> (0.89, 0.98, 0.90), and on
  # 12-04's AMX Xeon seed 0's SFT had not learned to copy by step 1,200. Where SFT leaves the model (how well it
  # copies) varies with the step at which copying appears, so the assertions are on GRPO's gains, below the smallest
  # seen over seeds: another machine's float reduction order changes the sampled tokens from some step on, as another
  # seed does.
  # Half the demonstrations answer at once, so SFT leaves the model calling in about half its episodes.
  assert before["calls"] < 0.8 and before["accuracy"] < 0.7, f"SFT left the model at {before}: little to show"
  assert after["accuracy"] > before["accuracy"] + 0.2
  # It learns to call the tool on the problems it cannot do alone.
  assert after["calls"] > before["calls"] + 0.2
  # An answer without the calculator is never right, so every point gained is a call.
  assert before["direct_right"] == after["direct_right"] == 0
