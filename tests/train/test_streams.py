"""GRPO's data (`ptx.train.streams`): each prompt encoded once, as the step reads it, and checked before training.

An rl record's chat messages go through the chat template once, with the generation prompt, and its environment
scores the completion; multi-turn episodes' batches hold each episode's first prompt as the environment poses it
(docqa's records have no "prompt"), and that prompt, not the record's, is what must fit data.seq_len.
"""

import dataclasses
import json

import numpy as np
import pytest

from ptx.config import ConfigError
from ptx.data.chat import encode_chat
from ptx.data.records import RecordError
from ptx.data.tokenizer import ByteTokenizer
from ptx.envs.calculator import CalculatorEnv, CalculatorTasks
from ptx.envs.docqa import DocQAEnv, DocQATasks
from ptx.envs.exact_answer import ExactAnswerEnv
from ptx.episodes.scoring import EnvReward
from ptx.episodes.turn_format import TurnFormat
from ptx.train import presets, streams

TOK = ByteTokenizer()


def _cfg(files=(), **data):
  cfg = presets.TOY["grpo"]()
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_files=tuple(map(str, files)), batch_size=2,
                                                           **data))


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _prompt(batch, i):
  """Row i's prompt tokens, its left padding dropped."""
  return batch["prompts"][i, batch["prompts"].shape[1] - batch["prompt_lengths"][i]:].tolist()


def _episode_prompt(env, task):
  """The first prompt `ptx.episodes.loop.play` encodes for an episode of `task`."""
  episode = env.reset(task)
  try:
    return TurnFormat.of(TOK).prompt(episode.prompt)
  finally:
    episode.close()


def test_chat_format_records_are_rendered_once_and_scored_by_the_environment(tmp_path):
  rows = [{"prompt": [{"role": "system", "content": "Reply with the sum."}, {"role": "user", "content": f"{i}+{i}="}],
           "answer": str(2 * i)} for i in range(2)]
  cfg = _cfg([_jsonl(tmp_path / "chat.jsonl", rows)], seq_len=128)
  env = ExactAnswerEnv()
  batch = next(streams.grpo_prompts(cfg, TOK, streams.rl_tasks(cfg, TOK, env, ("answer",)), in_graph=False))
  for i, row in enumerate(rows):
    assert _prompt(batch, i) == encode_chat(TOK, row["prompt"], add_generation_prompt=True)[0]
  text = TOK.decode(_prompt(batch, 1))
  assert text.count("<|im_start|>") == 3 and text.endswith("1+1=<|im_end|>\n<|im_start|>assistant\n")
  # Two samples a task: the right sum, then a wrong one.
  completions = np.asarray([TOK.encode(f"#### {n}") for n in (0, 1, 2, 3)], np.int32)
  rewards = EnvReward(env, TOK, (TOK.eos_id,), group_size=2)(completions, np.full(4, 6), batch["task"])
  np.testing.assert_array_equal(rewards, [1.0, 0.0, 1.0, 0.0])


def test_episode_batches_hold_each_episodes_first_prompt_and_docqa_records_need_no_prompt(tmp_path):
  env, rows = DocQAEnv(TOK), [DocQATasks(0)[i] for i in range(2)]
  assert all("prompt" not in row for row in rows)
  cfg = _cfg([_jsonl(tmp_path / "docqa.jsonl", rows)], seq_len=1100)
  tasks = streams.rl_tasks(cfg, TOK, env, ("document", "question", "answer"), episodes=True)
  batch = next(streams.grpo_prompts(cfg, TOK, tasks, in_graph=False, episodes=env))
  assert [_prompt(batch, i) for i in range(2)] == [_episode_prompt(env, row) for row in rows]
  assert [task["question"] for task in batch["task"]] == [row["question"] for row in rows]
  env, tasks = CalculatorEnv(), CalculatorTasks(0)
  batch = next(streams.grpo_prompts(_cfg(seq_len=448), TOK, tasks, in_graph=False, episodes=env))
  assert [_prompt(batch, i) for i in range(2)] == [_episode_prompt(env, tasks[i]) for i in range(2)]


def test_a_record_whose_episode_prompt_is_too_long_is_named_though_its_own_prompt_fits(tmp_path):
  task = CalculatorTasks(0)[0]
  n = len(_episode_prompt(CalculatorEnv(), task))
  assert len(TOK.encode(task["prompt"])) + 1 < 200 < n  # the tool's instructions and the chat template add the rest
  path = _jsonl(tmp_path / "calculator.jsonl", [task])
  with pytest.raises(RecordError) as e:
    streams.rl_tasks(_cfg([path], seq_len=200), TOK, CalculatorEnv(), ("answer",), episodes=True)
  assert str(e.value) == (f"{path}:1: its episode's first prompt takes {n} tokens, more than prompt_len=200 "
                          f"(data.seq_len: set data.seq_len={n} or more)")


def test_built_in_episode_tasks_too_long_for_seq_len_are_refused_naming_the_flag_and_the_longest():
  env, tasks = CalculatorEnv(), CalculatorTasks(0)
  cfg = _cfg(seq_len=8)  # the toy preset's, sized for 2-digit addition
  lengths = [len(_episode_prompt(env, tasks[i])) for i in range(streams.SCAN)]
  longest = max(lengths)
  with pytest.raises(ConfigError) as e:
    streams.check_builtin_prompts(cfg, TOK, env, tasks, episodes=True)
  assert str(e.value) == (f"data.seq_len=8 is shorter than the first prompt of an episode of task "
                          f"{lengths.index(longest)}: {longest} tokens, the longest of the first {streams.SCAN} tasks "
                          f"(calculator's text in the chat template): set data.seq_len={longest} or more")
  streams.check_builtin_prompts(_cfg(seq_len=longest), TOK, env, tasks, episodes=True)
