"""Terminal tasks for `ShellEnv`: a small project with a bug, a shell to fix it in, a hidden check that runs the fix.

`TerminalTasks(seed, split)[i]` is a `ShellEnv` record (`{"prompt", "files",
"check", "check_files"}`), a pure function of (seed, i, split). Each comes
from one of `VARIANTS`, eleven bug families times four themes; a theme
changes the files, functions, columns and messages, and the draw changes the
data and with it every expected value:

- skip_first: a loop over CSV rows starts at 1 (the first row is lost from a total);
- comparison: a count uses `>` for `>=` (or `<`, `<=`), shown by a failing unit test;
- mutable_default: a list default argument that remembers earlier calls (unit test);
- str_sort: numbers read as strings, so the "top three" are sorted as text;
- missing_return: a helper computes a mean and does not return it (TypeError);
- wrong_path: the program opens its input under the wrong directory (FileNotFoundError);
- config_value: a percentage in the JSON configuration is wrong;
- unit_test: a small module (word count, leap years, clamp, initials) fails its unit test;
- shell_script: a POSIX sh script (case-sensitive grep, `wc -l FILE`, a sum that
  forgets to add, `sort` without `-n`);
- group_totals: a per-group total assigns instead of adding;
- swapped_args: a percentage computed as whole/part.

The prompt says what the user sees: its first `code span` is the command that
shows the failure (a program, or a visible unit test), and a fenced block,
when there is one, is what that command should print for the current data.
The fix is a line or two in one file of at most a dozen lines. Train and
held-out are disjoint by variant (`ptx.data.splits` on "family/theme"): a
workspace's fix does not depend on its data, so a held-out task is code the
policy never trained on, not new numbers in a program it did. The hash puts
9 of the 44 variants (from 7 of the 11 families) on the held-out side.

The hidden check (`check_files`, never in the workspace while the model acts;
see `ShellEnv`) holds the reference workspace (the fixed project) and hidden
cases: input files the model never saw (new data, or a script making new calls
of the module's function) and the command to run. It makes itself undumpable,
reads them and deletes its directory, runs the reference on every case in
scratch directories it then deletes, and only then runs each case in the
model's final workspace, with a clean environment; the reward is 1 when every
run exits 0 and prints exactly what the reference printed. So the reward
cannot be fooled by: an exit status (`exit 0`, `sys.exit(0)` at import: the
output must match); output hard-coded for the visible data; deleting or
editing the visible tests, or a planted `unittest.py` or `conftest.py` (the
check never runs them; the sandbox has no pytest); an `__eq__` that equals
everything (results cross as printed JSON); a `json.py`, `sitecustomize.py` or
`usercustomize.py` planted for the check itself (ShellEnv starts it with
PYTHONSAFEPATH and PYTHONNOUSERSITE); reading the check, the reference or the
expected outputs while the model's program runs (nothing of them is left on
disk, and PR_SET_DUMPABLE closes the check's `/proc/PID/mem` and `fd`); moving
the data to where a wrong path points (the hidden inputs go where the task
says); hanging (the sandbox's time limit ends the check: reward 0). Not
defended: a fix that is right on the hidden cases and wrong elsewhere (three
runs, or three or four calls, per task). Under the weaker rlimits backend
without root, a program can see other checks' scratch directories on the host
(see `ptx.sandbox.run`).

`reference_fix(record)` returns shell commands that solve a record, for
tests and baselines. It reads the record's own check files, so it cannot
drift from what the check expects, and it adds nothing to what an episode
sees: the record is the environment's input, and a field there holding the
fix would be one leak away from the model.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from ptx.data import splits
from ptx.envs import terminal_bugs

# The check, run by ShellEnv as `python3 "$CHECK_DIR/check.py"` next to task.json ({"ref": files, "cases": [[argv,
# files], ...]}). No timeouts of its own: the sandbox's wall clock ends a program that hangs, and the check with it.
_CHECK = '''\
"""A terminal task's hidden check: the reference's outputs on hidden inputs, then the model's workspace's."""
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

# No process of this uid may read this one's memory (/proc/PID/mem): the expected outputs will be there.
if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
  sys.exit("check: prctl(PR_SET_DUMPABLE, 0) failed")
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "task.json")) as f:
  task = json.load(f)
shutil.rmtree(here)
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": tempfile.mkdtemp(),
       "PYTHONDONTWRITEBYTECODE": "1"}


def put(root, files):
  for name, text in files.items():
    path = os.path.join(root, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path)
    elif os.path.lexists(path):
      os.unlink(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      f.write(text)


def run(root, argv):
  done = subprocess.run(argv, cwd=root, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL)
  return done.returncode, done.stdout


expected = []
for argv, files in task["cases"]:
  root = tempfile.mkdtemp()
  put(root, task["ref"])
  put(root, files)
  expected.append(run(root, argv))
  shutil.rmtree(root)  # before any of the model's code runs
  if expected[-1][0] != 0:
    sys.exit(f"check: the reference failed on {argv}")
for k, ((argv, files), want) in enumerate(zip(task["cases"], expected)):
  put(".", files)
  if run(".", argv) != want:
    sys.exit(f"check: hidden case {k} ({' '.join(argv)}) printed something else or failed")
'''

# "family/first name of the theme": a variant's identity, and its side of the train / held-out split.
VARIANTS = tuple(f"{family}/{theme[0]}" for family, (_, themes) in terminal_bugs.FAMILIES.items() for theme in themes)


@dataclasses.dataclass(frozen=True)
class TerminalTasks:
  """Buggy projects to fix in a shell (see the module docstring); task i a pure function of (seed, i, split).

  Attributes:
    seed: selects the stream.
    split: "train" or "held_out" (`ptx.data.splits`, by variant: family and theme).
  """

  seed: int = 0
  split: str = "train"

  def __post_init__(self):
    splits.check("TerminalTasks", self.split)

  def __getitem__(self, i: int) -> dict[str, Any]:
    """Task i: a `ShellEnv` record `{"prompt", "files", "check", "check_files"}`."""
    variant, rng = self._draw(i)
    family, name = variant.split("/")
    build, themes = terminal_bugs.FAMILIES[family]
    project = build(next(t for t in themes if t[0] == name), rng)
    ref = {**project.files, **project.fixed}
    return {"prompt": project.prompt, "files": project.files, "check": 'python3 "$CHECK_DIR/check.py"',
            "check_files": {"check.py": _CHECK, "task.json": json.dumps({"ref": ref, "cases": project.cases})}}

  def variant(self, i: int) -> str:
    """Task i's variant, "family/theme" (one of VARIANTS): for metrics by family."""
    return self._draw(i)[0]

  def _draw(self, i: int) -> tuple[str, np.random.Generator]:
    """Task i's variant, and the random stream its data comes from next."""
    if not isinstance(i, int) or i < 0:
      raise ValueError(f"TerminalTasks index must be an int >= 0, got {i!r}")
    rng = np.random.default_rng([self.seed, i, splits.SPLITS.index(self.split)])

    def candidate():
      variant = VARIANTS[int(rng.integers(len(VARIANTS)))]
      return variant, variant

    return splits.draw("TerminalTasks", self.split, candidate), rng


def reference_fix(record: dict[str, Any]) -> list[str]:
  """Shell commands that fix a `TerminalTasks` record: each file the reference changes, rewritten.

  Args:
    record: a record from `TerminalTasks`.

  Returns:
    One `cat > FILE <<'EOF'` command per file to rewrite.
  """
  ref = json.loads(record["check_files"]["task.json"])["ref"]
  return [f"cat > {path} <<'EOF'\n{text}EOF" for path, text in ref.items() if record["files"].get(path) != text]
