"""The calculator environment: exact arithmetic, held-out problems disjoint by construction, the hacks it refuses."""

import pytest

from ptx.envs.base import Outcome
from ptx.envs.calculator import CalculatorEnv, CalculatorTasks, calculate
from ptx.envs.tools import FORMATS


def _call(expression):
  return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def test_calculate_is_exact_on_integers_and_refuses_everything_but_arithmetic():
  assert calculate("6405 * 560 + 3428") == "3590228"
  assert calculate("-(2 ** 10) // 3 % 7") == str(-(2 ** 10) // 3 % 7)
  assert calculate("10 / 4") == "2.5" and calculate("1 / 3") == "0.333333333333"
  for bad, why in [("__import__('os').system('id')", "not Call"), ("answer", "not Name"),
                   ("(1).__class__", "not Attribute"), ("9 ** 99999", "exponents are limited"),
                   ("10 ** 31", "out of range"), ("(-1) ** 0.5", "complex"), ("1 / 0", "division by zero"),
                   ("1 +", "not an arithmetic expression"), ("1+" * 150 + "1", "longer than 200"),
                   ("[1, 2]", "not List"), ("'7'", "not Constant")]:
    with pytest.raises(ValueError, match=why.replace("(", r"\(")):
      calculate(bad)


def test_tasks_are_reproducible_and_train_and_held_out_never_share_a_problem():
  train, held = CalculatorTasks(seed=0), CalculatorTasks(seed=0, split="held_out")
  assert train[3] == CalculatorTasks(seed=0)[3] and train[3] != CalculatorTasks(seed=1)[3]
  train_prompts = {train[i]["prompt"] for i in range(400)}
  held_prompts = {held[i]["prompt"] for i in range(400)}
  assert len(train_prompts) > 390 and len(held_prompts) > 390
  assert not train_prompts & held_prompts
  # Hard to do in one's head: a product of a 3-4 digit and a 3 digit number, then a 4-digit term.
  assert all(train[i]["answer"] > 10_000 for i in range(50))
  with pytest.raises(ValueError, match="split must be one of"):
    CalculatorTasks(split="test")


def test_an_episode_answers_tool_calls_then_scores_one_answer():
  task = CalculatorTasks()[0]
  episode = CalculatorEnv().reset(task)
  assert "calculator(expression)" in episode.prompt and "<tool_call>" in episode.prompt
  step = episode.step(_call("6405 * 560"))
  assert not step.done and step.observation == "3586800" and (step.tool_calls, step.tool_errors) == (1, 0)
  step = episode.step(_call("1 / 0") + _call("2 + 2"))
  assert step.observation == "error: calculator failed: ValueError: division by zero\n4"
  assert (step.tool_calls, step.tool_errors) == (2, 1)
  assert "no `Answer: <integer>` found" in episode.step("hmm, let me think").observation
  final = episode.step(f"Answer: {task['answer']:,}")
  assert final.done and final.outcome == Outcome.OK and final.reward == 1.0
  wrong = CalculatorEnv().reset(task).step(f"Answer: {task['answer'] + 1}")
  assert wrong.outcome == Outcome.WRONG and wrong.reward == 0.0


def test_the_hacks_a_policy_would_try_score_nothing():
  task = CalculatorTasks()[5]
  right = task["answer"]
  # Listing several answers, one of them right.
  shotgun = CalculatorEnv().reset(task).step(f"Answer: {right - 1}\nAnswer: {right + 1}\nAnswer: {right}")
  assert shotgun.outcome == Outcome.WRONG and shotgun.reward == 0.0
  # An answer hidden in a tool-calling turn is not an answer: the turn only gets the tool's results.
  hidden = CalculatorEnv().reset(task).step(_call("1 + 1") + f" Answer: {right}")
  assert not hidden.done and hidden.observation == "2"
  # Reaching the task's answer (or anything else in the process) through the calculator.
  for probe in ("answer", "task['answer']", "globals()", "__import__('ptx')"):
    step = CalculatorEnv().reset(task).step(_call(probe))
    assert not step.done and step.observation.startswith("error: calculator failed: ValueError: only numbers")
  # A malformed call costs the turn, never the episode (and is not a model-caused infra error).
  broken = CalculatorEnv().reset(task).step('<tool_call>{"name": "calculator", </tool_call>')
  assert not broken.done and broken.observation.startswith("error: the tool call is not valid JSON")
  # Only the record's own answer scores: a record without one is refused by name.
  with pytest.raises(ValueError, match="calculator task record needs field 'answer'"):
    CalculatorEnv().reset({"prompt": "1+1"})


@pytest.mark.parametrize("tool_format", FORMATS)
def test_a_demonstration_is_an_episode_the_environment_scores_1(tool_format):
  env = CalculatorEnv(tool_format=tool_format)
  task = CalculatorTasks(seed=3)[7]
  demo = env.demonstration(task)
  assert [m["role"] for m in demo] == ["user", "assistant", "tool", "assistant"]
  # Replayed through a fresh episode, the assistant turns get the demonstration's observations, then reward 1.
  episode = env.reset(task)
  assert demo[0]["content"] == episode.prompt
  call = episode.step(demo[1]["content"])
  assert not call.done and call.observation == demo[2]["content"] == str(task["answer"])
  assert (call.tool_calls, call.tool_errors) == (1, 0)
  final = episode.step(demo[3]["content"])
  assert final.done and final.outcome == Outcome.OK and final.reward == 1.0
  assert task["expression"] in demo[1]["content"]


def test_a_demonstration_needs_the_records_expression_and_its_value_to_be_the_answer():
  with pytest.raises(ValueError, match="calculator task record needs field 'expression'"):
    CalculatorEnv().demonstration({"prompt": "1+1?", "answer": 2})
  with pytest.raises(ValueError, match=r"field 'expression' \('1 \+ 2'\) is not the answer: 3 is not 2"):
    CalculatorEnv().demonstration({"prompt": "1+1?", "answer": 2, "expression": "1 + 2"})
  with pytest.raises(ValueError, match=r"field 'expression' \('two'\): the calculator answered 'error: "):
    CalculatorEnv().demonstration({"prompt": "1+1?", "answer": 2, "expression": "two"})


def test_without_instructions_the_prompt_is_the_problem_alone():
  task = CalculatorTasks()[0]
  assert CalculatorEnv(instructions=False).reset(task).prompt == task["prompt"]
  assert CalculatorEnv(instructions=False).demonstration(task)[0]["content"] == task["prompt"]


DIGITS = "1" * 5000  # past Python's 4,300-digit limit on converting text to int
# Per format: calls the standard library's parsers refuse with other than a syntax error (an integer too long, nesting
# too deep, a literal that does not evaluate, a parser stack overflow).
UNREADABLE = {
    "hermes": ['<tool_call>{"name": "calculator", "arguments": {"expression": %s}}</tool_call>' % DIGITS,
               "<tool_call>" + "[" * 1000 + "]" * 1000 + "</tool_call>"],
    "smollm2": ['<tool_call>[{"name": "calculator", "arguments": {"expression": %s}}]</tool_call>' % DIGITS,
                "<tool_call>" + "[" * 1000 + "]" * 1000 + "</tool_call>"],
    "llama3": ['{"name": "calculator", "parameters": {"expression": %s}}' % DIGITS,
               '{"name": "calculator", "parameters": ' + "[" * 1000 + "]" * 1000 + "}"],
    "gemma": ["```tool_code\ncalculator(expression={[1]})\n```",
              "```tool_code\ncalculator(expression=" + "-" * 100_000 + "1)\n```"],
}


@pytest.mark.parametrize("tool_format", FORMATS)
def test_a_policys_unreadable_output_costs_it_the_turn_or_the_answer_never_the_environment(tool_format):
  task = CalculatorTasks()[2]
  env = CalculatorEnv(tool_format=tool_format)
  for call in UNREADABLE[tool_format]:
    step = env.reset(task).step(call)
    assert not step.done and step.observation.startswith("error: ") and (step.tool_calls, step.tool_errors) == (1, 1)
  # An answer too long to convert is wrong (it is longer than the task's); leading zeros do not make a right one so.
  huge = env.reset(task).step(f"Answer: {DIGITS}")
  assert huge.done and huge.outcome == Outcome.WRONG and huge.reward == 0.0
  padded = env.reset(task).step(f"Answer: {'0' * 5000}{task['answer']}")
  assert padded.outcome == Outcome.OK and padded.reward == 1.0
  # Thousands of unclosed call openings are no call: the turn gets the reminder.
  opening = {"hermes": "<tool_call>", "smollm2": "<tool_call>[", "llama3": "<|python_tag|>",
             "gemma": "```tool_code\n"}[tool_format]
  assert "no `Answer: <integer>` found" in env.reset(task).step(opening * 8000).observation
