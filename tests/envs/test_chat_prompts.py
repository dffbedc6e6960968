"""A record's prompt may be chat messages: every environment takes them and scores the completion as for a string.

The data layer renders the messages for the model (`ptx.data.records`); a single-turn environment reads only the
request's text, and a multi-turn one poses its task as one user turn, so its messages must be just that.
"""

import pytest
from episodes import one_step

from ptx.data.tokenizer import ByteTokenizer
from ptx.envs import base, calculator, countdown, docqa, exact_answer, needle, python_tests, shell, terminal

SYSTEM = {"role": "system", "content": "Reply briefly."}
_COUNTDOWN = countdown.CountdownTask(0)[0]
_NEEDLE = needle.NeedleTask(0, lengths=(50,))[0]
# name: (environment, a record with a string prompt, a right completion, a wrong one)
SINGLE_TURN = {
    "exact_answer": (exact_answer.ExactAnswerEnv(), {"prompt": "What is 1+1?", "answer": "2"}, "#### 2", "#### 3"),
    "code": (python_tests.PythonTestsEnv(), {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3"]},
             "```python\ndef add(a, b):\n  return a + b\n```", "```python\ndef add(a, b):\n  return a - b\n```"),
    "countdown": (countdown.CountdownEnv(), _COUNTDOWN, f"<answer>{_COUNTDOWN['solution']}</answer>",
                  "<answer>1 + 1</answer>"),
    "needle": (needle.NeedleEnv(), _NEEDLE, f"It is {_NEEDLE['answer']}.", "It is 0."),
}


def _chat(task, *messages):
  return {**task, "prompt": [*messages, {"role": "user", "content": task["prompt"]}]}


@pytest.mark.parametrize("name", sorted(SINGLE_TURN))
def test_a_single_turn_environment_scores_a_chat_prompt_as_its_string_prompt(name):
  env, task, right, wrong = SINGLE_TURN[name]
  chat = _chat(task, SYSTEM)
  env.validate(chat)
  for completion, outcome in ((right, "ok"), (wrong, "wrong")):
    assert one_step(env, chat, completion).outcome == one_step(env, task, completion).outcome == outcome
  episode = env.reset(chat)
  assert episode.prompt == env.reset(task).prompt  # the request's text: the data layer renders the rest
  episode.close()


MULTI_TURN = {"calculator": (calculator.CalculatorEnv(), calculator.CalculatorTasks(0)[0]),
              "shell": (shell.ShellEnv(), terminal.TerminalTasks(0)[0])}


@pytest.mark.parametrize("name", sorted(MULTI_TURN))
def test_a_multi_turn_environment_poses_a_single_user_message_as_its_string_prompt(name):
  env, task = MULTI_TURN[name]
  chat = _chat(task)
  env.validate(chat)
  assert base.first_prompt(env, chat) == base.first_prompt(env, task)
  assert task["prompt"] in base.first_prompt(env, task)


def test_a_chat_prompt_plays_a_calculator_episode_to_its_reward():
  env, task = MULTI_TURN["calculator"]
  assert one_step(env, _chat(task), f"Answer: {task['answer']}").reward == 1.0


@pytest.mark.parametrize("name", sorted(MULTI_TURN))
def test_a_multi_turn_environment_refuses_chat_messages_it_cannot_pose_as_one_user_turn(name):
  env, task = MULTI_TURN[name]
  with pytest.raises(ValueError, match=r"an episode starts from one user turn, so chat messages must be a single user "
                                       r"message, got roles \['system', 'user'\]"):
    env.validate(_chat(task, SYSTEM))


@pytest.mark.parametrize("prompt,error", [
    ([], "'messages' must be a non-empty list, got list"),
    ([{"role": "bot", "content": "1+1="}], "messages[0].role must be one of"),
    ([{"role": "user", "content": 2}], "messages[0].content must be a string, got int"),
    ({"role": "user", "content": "1+1="}, "must be a string or chat messages (a list of role/content objects), got "
                                          "dict"),
])
def test_bad_chat_messages_are_named_by_the_environment_and_the_field(prompt, error):
  with pytest.raises(ValueError) as e:
    exact_answer.ExactAnswerEnv().validate({"prompt": prompt, "answer": "2"})
  assert str(e.value).startswith("exact_answer task field 'prompt'") and error in str(e.value)


def test_docqa_needs_no_prompt_and_ignores_one():
  env, task = docqa.DocQAEnv(ByteTokenizer()), docqa.DocQATasks(0)[0]
  assert "prompt" not in task
  assert base.first_prompt(env, {**task, "prompt": [SYSTEM]}) == base.first_prompt(env, task)
