"""Multi-turn episodes over the engine: token-in/token-out trajectories, tools overlapping decoding, limits by name."""

import random
import threading

import jax
import numpy as np
import pytest
from scripted_episodes import ENGINE as CONFIG
from scripted_episodes import MODEL, ScriptedEnv

from ptx.data.chat import encode_chat
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import init_params
from ptx.models.decoder import forward, token_log_probs
from ptx.envs.base import Outcome
from ptx.episodes.loop import play
from ptx.episodes.turn_format import TurnFormat
from ptx.sampling import SamplingConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig

SAMPLING = SamplingConfig(temperature=1.0)
# The engine's log-probs against the training forward over the whole trajectory: the same float32 math in another
# summation order (paged attention in blocks vs the training kernel), a few ulps; see tests/sampling/test_engine.py.
ENGINE_VS_TRAINER_ATOL = 1e-5
TASKS = [{"prompt": f"task {i}", "turns": 1 + i % 3} for i in range(5)]


class MarkerTokenizer(ByteTokenizer):
  """Bytes, plus `<|im_end|>` as the one token 259 (as real chat tokenizers spell their end-of-turn marker)."""

  MARKER = "<|im_end|>"

  @property
  def vocab_size(self) -> int:
    return 260

  def encode(self, text: str) -> list[int]:
    out = []
    for i, piece in enumerate(text.split(self.MARKER)):
      out += ([259] if i else []) + super().encode(piece)
    return out

  def decode(self, ids) -> str:
    return "".join(self.MARKER if i == 259 else super(MarkerTokenizer, self).decode([i]) for i in ids)


@pytest.fixture(scope="module")
def model():
  return MODEL, init_params(MODEL, jax.random.key(0))


def _play(model, env, tasks=TASKS, *, fmt=None, seed=0, **kwargs):
  cfg, params = model
  engine = RolloutEngine(cfg, CONFIG, sampling=SAMPLING, seed=seed)
  kwargs.setdefault("max_turn_tokens", 6)
  trajectories = play(engine, params, env, tasks, fmt or TurnFormat(ByteTokenizer()), **kwargs)
  assert engine.allocator.in_use == 0 and not engine.busy  # every episode released its pages
  return trajectories


def test_trajectories_hold_the_sampled_tokens_and_the_replies_exactly(model):
  cfg, params = model
  fmt = TurnFormat(ByteTokenizer())
  engine = RolloutEngine(cfg, CONFIG, sampling=SAMPLING, seed=3)
  sampled = {}
  step = engine.step

  def recording_step(*args, **kwargs):
    completions = step(*args, **kwargs)
    for c in completions:
      sampled.setdefault(c.seq_id, []).append(c)
    return completions

  engine.step = recording_step
  env = ScriptedEnv()
  trajectories = play(engine, params, env, TASKS, fmt, samples=2, max_turn_tokens=6)
  assert [(t.task, t.sample) for t in trajectories] == [(i, g) for i in range(len(TASKS)) for g in range(2)]
  assert env.closed == 2 * len(TASKS)
  for seq_id, t in enumerate(trajectories):  # ids go in task, then sample order
    turns = sampled[seq_id]
    assert t.turns == len(turns) == TASKS[t.task]["turns"] and t.outcome == Outcome.OK and t.reward == 1.0
    # Rebuild the trajectory from what the engine sampled and the format's replies to the decoded text.
    expected, mask, messages = fmt.prompt(t.messages[0]["content"]), [], [t.messages[0]]
    mask = [0] * len(expected)
    for i, turn in enumerate(turns):
      expected += turn.tokens.tolist()
      mask += [1] * len(turn.tokens)
      messages.append({"role": "assistant", "content": fmt.action(turn.tokens)})
      if i + 1 < len(turns):
        reply = fmt.reply(messages, f"obs {i + 1} of {TASKS[t.task]['prompt']}", closed=False)
        expected += reply
        mask += [0] * len(reply)
        messages.append({"role": "tool", "content": f"obs {i + 1} of {TASKS[t.task]['prompt']}"})
    np.testing.assert_array_equal(t.tokens, expected)
    np.testing.assert_array_equal(t.loss_mask, mask)
    assert list(t.messages) == messages
    np.testing.assert_array_equal(t.log_probs[t.loss_mask == 1], np.concatenate([c.log_probs for c in turns]))
    assert set(t.log_probs[t.loss_mask == 0]) == {0.0} and set(t.policy_versions[t.loss_mask == 0]) == {-1}
    counts = t.source_tokens()
    assert counts["model"] == sum(len(c.tokens) for c in turns) and sum(counts.values()) == len(t.tokens)
  # What the environment was shown is the decoded text of exactly those tokens.
  assert [e.actions for e in env.episodes] == [[m["content"] for m in t.messages if m["role"] == "assistant"]
                                               for t in trajectories]

  # The cache an episode decodes from, extended turn after turn, is the full context's: every sampled token's
  # log-prob equals the training forward's over the whole trajectory.
  width = max(len(t.tokens) for t in trajectories)
  tokens = np.zeros((len(trajectories), width), np.int32)
  for row, t in enumerate(trajectories):
    tokens[row, :len(t.tokens)] = t.tokens
  logp = np.asarray(token_log_probs(forward(params, tokens, cfg)[:, :-1], tokens[:, 1:]))
  for row, t in enumerate(trajectories):
    model_positions = np.nonzero(t.loss_mask)[0]
    np.testing.assert_allclose(t.log_probs[model_positions], logp[row, model_positions - 1],
                               atol=ENGINE_VS_TRAINER_ATOL, rtol=0)


def test_tools_run_while_the_engine_decodes_other_episodes(model):
  # Task 0's first tool call returns only once another episode has taken its second turn: a loop that waited for
  # every tool of a turn before decoding again would never get there, and the call would give up.
  others_went_on = threading.Event()

  def hook(task, calls):
    if task["prompt"] == "task 0" and calls == 1:
      if not others_went_on.wait(timeout=120):
        raise TimeoutError("no other episode took a turn while this tool ran")
    elif calls == 2:
      others_went_on.set()

  trajectories = _play(model, ScriptedEnv(hook=hook), [{"prompt": "task 0", "turns": 2}] +
                       [{"prompt": f"task {i}", "turns": 3} for i in range(1, 3)])
  assert [t.outcome for t in trajectories] == [Outcome.OK] * 3
  assert trajectories[0].tool_wait_s > 0


def test_lockstep_runs_tools_while_the_engine_decodes_and_takes_replies_when_it_drains(model):
  # The long prompt's context leaves its turn 2 tokens, the short one's 6: the long turn ends a decode call (4 steps)
  # earlier, and its tool returns only once the engine has decoded again. A loop that waited for every tool before
  # each call would never get there, and the call would give up (an infrastructure error).
  cfg, params = model
  fmt = TurnFormat(ByteTokenizer())
  engine = RolloutEngine(cfg, CONFIG, sampling=SAMPLING, seed=0)
  calls, decoded = [0], threading.Condition()
  step = engine.step

  def counting_step(*args, **kwargs):
    completions = step(*args, **kwargs)
    with decoded:
      calls[0] += 1
      decoded.notify_all()
    return completions

  def hook(task, n):
    if task["prompt"].startswith("long"):
      with decoded:
        started = calls[0]
        if not decoded.wait_for(lambda: calls[0] > started, timeout=60):
          raise TimeoutError("the engine decoded nothing while this tool ran")

  engine.step = counting_step
  tasks = [{"prompt": "long " + "x" * 24, "turns": 2}, {"prompt": "short", "turns": 1}]
  context = len(fmt.prompt(tasks[0]["prompt"])) + 2
  assert context - len(fmt.prompt(tasks[1]["prompt"])) >= 6
  long, short = play(engine, params, ScriptedEnv(hook=hook), tasks, fmt, max_turn_tokens=6, max_context=context,
                     lockstep=True)
  assert len(long.tokens) == context and long.outcome == Outcome.LIMIT  # no room for its reply: not INFRA_ERROR
  assert short.outcome == Outcome.OK and short.loss_mask.sum() == 6


def test_the_same_seed_gives_the_same_trajectories_whatever_the_tools_timing(model):
  def jitter(seed):
    rng, lock = random.Random(seed), threading.Lock()

    def hook(task, calls):
      with lock:
        delay = rng.uniform(0, 0.03)
      threading.Event().wait(delay)
    return hook

  first = _play(model, ScriptedEnv(hook=jitter(0)), samples=2)
  second = _play(model, ScriptedEnv(hook=jitter(1)), samples=2)
  for a, b in zip(first, second, strict=True):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    # Tool timing changes which rows share a decode call, so the call's row count and pairs of pages differ and
    # a row's float32 sums run in another order: log-probs move by an ulp or two (seen 9.5e-7), tokens not at all.
    np.testing.assert_allclose(a.log_probs, b.log_probs, atol=2e-6, rtol=0)
  # In lockstep every call is a function of the tokens alone: bitwise alike under any timing (the jitter above
  # moves the log-probs of most episodes when the engine does not wait).
  locked = [_play(model, ScriptedEnv(hook=jitter(seed)), samples=2, lockstep=True) for seed in (2, 3)]
  for a, b, c in zip(*locked, first, strict=True):
    np.testing.assert_array_equal(a.tokens, c.tokens)
    np.testing.assert_array_equal(a.log_probs, b.log_probs)
  other = _play(model, ScriptedEnv(), seed=1, samples=2)
  assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(first, other))


def test_infrastructure_errors_turn_limits_and_full_contexts_end_episodes_by_name(model):
  env = ScriptedEnv(max_turns=2, fail="task 1")
  tasks = [{"prompt": "task 0", "turns": 9}, {"prompt": "task 1", "turns": 2}, {"prompt": "task 2", "turns": 1}]
  out = _play(model, env, tasks)
  assert [t.outcome for t in out] == [Outcome.NO_ANSWER, Outcome.INFRA_ERROR, Outcome.OK]
  assert "out of turns (2)" in out[0].reason and out[0].turns == 2 and out[0].reward == 0.0
  assert out[1].infra_error and "OSError: the tool's machine went away" in out[1].reason and out[1].turns == 1
  assert env.closed == 3

  # A context that holds the prompt and one turn: the episode ends when the reply cannot fit, scored 0.
  prompt = TurnFormat(ByteTokenizer()).prompt("task 0")
  (full,) = _play(model, ScriptedEnv(), [{"prompt": "task 0", "turns": 3}], max_context=len(prompt) + 12)
  assert full.outcome == Outcome.LIMIT and full.reward == 0.0 and full.turns == 1 and "context of" in full.reason
  assert len(full.tokens) <= len(prompt) + 12
  # The episode's own budget binds before the turn's: never a token past it (a training row is that wide).
  bounded = _play(model, ScriptedEnv(), [{"prompt": "task 0", "turns": 3}], samples=4, max_turn_tokens=40,
                  max_episode_tokens=20)
  assert max(len(t.tokens) - t.prompt_len for t in bounded) == 20

  with pytest.raises(ValueError, match="task 0: its prompt of .* leaves no room"):
    _play(model, ScriptedEnv(), [{"prompt": "x" * 400, "turns": 1}])


def test_episodes_reserve_their_context_so_no_turn_waits_for_another_episodes_pages(model):
  # Pages for about two whole contexts: later groups wait for admission, never a running episode's next turn.
  cfg, params = model
  config = EngineConfig(max_seqs=4, pages=2 * -(-256 // 8) + 2, page_size=8, max_seq_len=256, decode_steps=4,
                        prefill_chunk=32, prefill_rows=2)
  engine = RolloutEngine(cfg, config, sampling=SAMPLING)
  tasks = [{"prompt": f"t{i}", "turns": 3} for i in range(6)]
  out = play(engine, params, ScriptedEnv(), tasks, TurnFormat(ByteTokenizer()), max_turn_tokens=4)
  assert [t.outcome for t in out] == [Outcome.OK] * 6
  assert engine.allocator.peak_in_use <= config.pages and engine.allocator.in_use == 0


def test_turn_format_ends_turns_at_a_one_token_marker_and_writes_it_when_the_model_did_not():
  byte, marker = TurnFormat(ByteTokenizer()), TurnFormat(MarkerTokenizer())
  assert byte.end_of_turn == marker.end_of_turn == "<|im_end|>"
  assert byte.stop_ids == (2,) and marker.stop_ids == (259,)  # eos where the marker is ten byte tokens
  history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ls"}]
  tail = "\n<|im_start|>tool\nfile.txt<|im_end|>\n<|im_start|>assistant\n"
  assert marker.reply(history, "file.txt", closed=True) == MarkerTokenizer().encode(tail)
  assert marker.reply(history, "file.txt", closed=False) == MarkerTokenizer().encode("<|im_end|>" + tail)
  assert byte.reply(history, "file.txt", closed=True) == ByteTokenizer().encode("<|im_end|>" + tail)
  with pytest.raises(ValueError, match="must end with the model's turn"):
    marker.reply(history[:1], "x", closed=True)


def test_render_check_finds_where_a_trajectory_departs_from_the_templates_rendering():
  tok = MarkerTokenizer()
  fmt = TurnFormat(tok)
  messages = [{"role": "user", "content": "list"}, {"role": "assistant", "content": "ls"},
              {"role": "tool", "content": "a b"}, {"role": "assistant", "content": "DONE"}]
  # The model spelled each turn as the tokenizer does and closed it with the marker: the trajectory is the
  # template's rendering token for token.
  tokens = fmt.prompt("list") + tok.encode("ls") + [259]
  tokens += fmt.reply(messages[:2], "a b", closed=True) + tok.encode("DONE") + [259]
  assert tokens + tok.encode("\n") == encode_chat(tok, messages)[0] and fmt.render_check(messages, tokens) is None
  # A turn the tokenizer would have spelled otherwise (here: a byte token where the marker is one) is reported.
  drifted = tokens[:len(fmt.prompt("list"))] + tok.encode("ls") + ByteTokenizer().encode("<|im_end|>")
  assert fmt.render_check(messages, drifted) == len(fmt.prompt("list")) + 2
  # A byte tokenizer's turns end at eos, which the rendering writes as the marker's bytes.
  byte = TurnFormat(ByteTokenizer())
  tokens = byte.prompt("list") + ByteTokenizer().encode("ls") + [2] + byte.reply(messages[:2], "a b", closed=True)
  assert byte.render_check(messages[:3], tokens) == len(byte.prompt("list")) + 2


def test_an_engine_whose_pages_are_held_says_it_is_stalled_and_run_names_the_waiting_sequence(model):
  cfg, params = model
  config = EngineConfig(max_seqs=4, pages=1 + 256 // 8, page_size=8, max_seq_len=256, decode_steps=4,
                        prefill_chunk=32, prefill_rows=2)
  engine = RolloutEngine(cfg, config, sampling=SAMPLING)
  (held,) = engine.submit([1, 5, 6], max_new_tokens=3, keep=True, reserve=256)  # every page of the pool
  engine.run(params)
  (waiting,) = engine.submit([1, 7], max_new_tokens=3)
  assert engine.step(params) == [] and engine.stalled
  with pytest.raises(RuntimeError, match=f"sequence {waiting} cannot be admitted"):
    engine.run(params)
  engine.release(held)
  assert len(engine.run(params)[waiting].tokens) == 3 and not engine.stalled and engine.allocator.in_use == 0
