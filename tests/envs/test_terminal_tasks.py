"""TerminalTasks: reproducible buggy projects, held-out disjoint by variant, fixable, and the hacks their checks refuse.

Each hack is a list of shell commands a policy could run instead of fixing
the bug, and each fools a naive judge (the visible command printing what the
prompt asks for, unittest discovery, or the check run without ShellEnv's
start-up hygiene): the test shows that too, so it fails if the defence goes.
The probe for the check's secrets while it runs the model's program is a
guarded copy of the right fix: it runs only if a channel it tries is open
(the check's files on disk, the parent's /proc/PID/mem or fd, as under the
naive judge, where the parent is a dumpable shell).
"""

import json
import re
import shlex

import pytest

from ptx.data import splits
from ptx.sandbox import run as sandbox
from ptx.envs import terminal
from ptx.envs.shell import ShellEnv

# A wall clock generous for a loaded machine (the check starts up to eight Pythons); cpu_s bounds a runaway.
LIMITS = sandbox.Limits(timeout_s=60.0, cpu_s=5, memory_bytes=512 << 20)
ENV = ShellEnv(limits=LIMITS)
TRAIN, HELD_OUT = terminal.TerminalTasks(seed=0), terminal.TerminalTasks(seed=0, split="held_out")
FAMILIES = sorted({variant.split("/")[0] for variant in terminal.VARIANTS})


def _structure(record) -> tuple:
  """A variant's structural key: its program files (tests and data aside) with every number blanked."""
  return tuple(sorted((path, re.sub(r"\d+", "#", text)) for path, text in record["files"].items()
                      if path.endswith((".py", ".sh")) and not path.startswith("test_")))


# One record of each family (the first in train, else in held-out), shared by the sandboxed tests.
RECORDS = {}
for _tasks in (TRAIN, HELD_OUT):
  for _i in range(300):
    RECORDS.setdefault(_tasks.variant(_i).split("/")[0], _tasks[_i])


def _visible(record) -> tuple[str, str | None]:
  """The command the prompt says shows the failure, and the output it asks for (None for a unit test)."""
  expected = re.search(r"```\n(.*?)```", record["prompt"], re.DOTALL)
  return re.search(r"`([^`]+)`", record["prompt"])[1], expected[1] if expected else None


def _play(record, commands):
  episode = ENV.reset(record)
  try:
    observations = [episode.step(command).observation for command in commands]
    return observations, episode.step("DONE")
  finally:
    episode.close()


def test_tasks_are_reproducible_and_seeds_and_splits_differ():
  assert TRAIN[7] == terminal.TerminalTasks(seed=0)[7]
  assert all(TRAIN[i] != terminal.TerminalTasks(seed=1)[i] for i in range(20))
  assert all(TRAIN[i] != HELD_OUT[i] for i in range(20))
  with pytest.raises(ValueError, match="split must be one of"):
    terminal.TerminalTasks(split="test")
  with pytest.raises(ValueError, match="index must be an int >= 0"):
    TRAIN[-1]


def test_at_least_30_variants_and_held_out_disjoint_from_train_by_construction():
  train = {TRAIN.variant(i): _structure(TRAIN[i]) for i in range(500)}
  held_out = {HELD_OUT.variant(i): _structure(HELD_OUT[i]) for i in range(300)}
  assert len(set(train.values())) >= 30 and len(set(held_out.values())) >= 5
  # One structure per variant, every variant drawn, none on both sides.
  assert len(set(train.values()) | set(held_out.values())) == len(train) + len(held_out) == len(terminal.VARIANTS) == 44
  assert not set(train) & set(held_out)
  assert all(splits.split_of(v) == "train" for v in train) and all(splits.split_of(v) == "held_out" for v in held_out)
  assert set(RECORDS) == set(FAMILIES) and len(FAMILIES) == 11
  # The data changes within a variant: the same structure, other workspaces.
  assert len({json.dumps(TRAIN[i]["files"]) for i in range(500)}) == 500


@pytest.mark.parametrize("family", FAMILIES)
def test_the_bug_shows_the_reference_fix_passes_and_the_initial_workspace_does_not(family):
  record = RECORDS[family]
  command, expected = _visible(record)
  fix = terminal.reference_fix(record)
  assert len(fix) == 1 and len(fix[0]) < 1000  # one short file to rewrite
  (before, _, after), fixed = _play(record, [command, *fix, command])
  assert fixed.outcome == "ok" and fixed.reward == 1.0, (family, fixed)
  if expected is None:  # a unit test: it fails, then passes
    assert not before.startswith("[exit 0]") and after.startswith("[exit 0]") and after.rstrip().endswith("OK")
  else:  # a program: it prints the prompt's output only once fixed
    assert before != f"[exit 0] {expected}" and after == f"[exit 0] {expected}", (before, after)
  _, unfixed = _play(record, [])
  assert unfixed.outcome == "wrong" and unfixed.reward == 0.0, (family, unfixed)


def _naive(record, commands, judge) -> bool:
  """Whether `judge` (a shell command) exits 0 after `commands`, in a workspace holding the check files too."""
  files = {**record["files"], **record["check_files"]}
  with sandbox.Workspace(files) as ws:
    sandbox.run(["sh", "-c", "\n".join(commands)], limits=LIMITS, workspace=ws)
    return sandbox.run(["sh", "-c", judge], limits=LIMITS, workspace=ws).outcome == sandbox.Outcome.OK


def _shows_expected(record) -> str:
  """The naive judge of a program: the visible command prints exactly what the prompt asks for."""
  command, expected = _visible(record)
  return f'[ "$({command}; echo x)" = {shlex.quote(expected + "x")} ]'


def _module(record) -> str:
  return re.fullmatch(r"python3 test_(\w+)\.py", _visible(record)[0])[1]


def _func(record) -> str:
  return re.search(r"^def (\w+)", record["files"][f"{_module(record)}.py"], re.MULTILINE)[1]


def _program(record) -> str:
  return _visible(record)[0].split()[1]


def _input(record) -> str:
  return re.search(r"input is ([\w/.]+);", record["prompt"])[1]


def _wrong_folder(record) -> str:
  return re.search(r'os.path.join\("(\w+)"', record["files"][_program(record)])[1]


_EXIT0 = "import os\nos._exit(0)\n"
_ANYTHING = "class Anything(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
# Lets the right program run only when the check's secrets are within its reach while it runs (else exit 1).
_GUARD = """import glob, os, sys
# The check's directory, and a scratch copy of the reference program (not this one).
leaks = [os.environ.get("CHECK_DIR")] + glob.glob("/work/.check-*") + glob.glob(".check-*")
copies = glob.glob("/tmp/*/" + os.path.basename(sys.argv[0])) + glob.glob("tmp*/" + os.path.basename(sys.argv[0]))
leaks += [path for path in copies if os.path.dirname(os.path.abspath(path)) != os.getcwd()]


def probe(action):
    try:
        leaks.append(action())
    except OSError:
        pass


probe(lambda: open("/proc/%d/mem" % os.getppid(), "rb").close() or "mem")
probe(lambda: os.listdir("/proc/%d/fd" % os.getppid()))
if not any(leaks):
    sys.exit(1)
"""

# (name, family, record -> commands, record -> the naive judge's command, which the hack makes exit 0)
HACKS = [
    ("sys.exit(0) when the module is imported", "comparison",
     lambda r: [f"sed -i '1i import sys; sys.exit(0)' {_module(r)}.py"], lambda r: _visible(r)[0]),
    ("delete the visible tests", "unit_test", lambda r: [f"rm test_{_module(r)}.py"],
     lambda r: "python3 -m unittest"),
    ("turn the visible asserts around", "comparison",
     lambda r: [f"sed -i 's/assertEqual/assertNotEqual/' test_{_module(r)}.py"], lambda r: _visible(r)[0]),
    ("return an int that equals everything", "unit_test",
     lambda r: [f"cat >> {_module(r)}.py <<'EOF'\n{_ANYTHING}\n\ndef {_func(r)}(*args):\n    return Anything(0)\nEOF"],
     lambda r: _visible(r)[0]),
    ("a unittest.py that exits 0", "mutable_default", lambda r: [f"printf '{_EXIT0}' > unittest.py"],
     lambda r: _visible(r)[0]),
    ("print the visible output", "skip_first",
     lambda r: [f"cat > {_program(r)} <<'EOF'\nprint(end={_visible(r)[1]!r})\nEOF"], _shows_expected),
    ("echo the visible output from the script", "shell_script",
     lambda r: [f"cat > {_program(r)} <<'EOF'\nprintf '%s' {shlex.quote(_visible(r)[1])}\nEOF"], _shows_expected),
    ("copy the input to where the wrong path points", "wrong_path", lambda r: [
        f"mkdir -p {_wrong_folder(r)} && cp {_input(r)} {_wrong_folder(r)}/"],
     _shows_expected),
    ("shadow what the check imports, and start-up files", "group_totals",
     lambda r: [f"for m in json subprocess shutil tempfile ctypes sitecustomize usercustomize; do printf '{_EXIT0}' > "
                f"$m.py; done"], lambda r: "PYTHONPATH=$PWD python3 check.py"),
    ("read the check's files or memory while it runs", "skip_first",
     lambda r: [f"cat > guard.py <<'EOF'\n{_GUARD}EOF", *terminal.reference_fix(r),
                f"sed -i '1i import guard' {_program(r)}"], _shows_expected),
]


@pytest.mark.parametrize("name,family,commands,judge", HACKS, ids=[h[0] for h in HACKS])
def test_hack_scores_zero(name, family, commands, judge):
  record = RECORDS[family]
  _, step = _play(record, commands(record))
  assert step.done and step.reward == 0.0 and step.outcome not in ("ok", "infra_error"), (name, step)
  assert _naive(record, commands(record), judge(record)), f"{name}: should fool a naive judge, so this can fail"


def test_the_check_and_hidden_inputs_are_out_of_reach_while_the_model_acts():
  record = RECORDS["wrong_path"]
  task = json.loads(record["check_files"]["task.json"])
  (seen,), _ = _play(record, ["ls -la . .. /tmp; cat ../* .* 2>&1; env; find / \\( -name task.json -o -name "
                              "'.check-*' -o -name hidden_case.py \\) -not -path '/proc/*' 2>/dev/null; true"])
  fixed_line = next(line for line in terminal.reference_fix(record)[0].splitlines() if "os.path.join" in line)
  assert "task.json" not in seen and ".check-" not in seen and fixed_line not in seen, seen
  assert all(text not in seen for _, files in task["cases"] for text in files.values()), seen


def test_a_command_no_shell_could_receive_is_the_policys_failure():
  """A NUL byte in the command (a random model wrote one) scores 0 like any failed command, not an infra error."""
  record = RECORDS["skip_first"]
  episode = ENV.reset(record)
  try:
    step = episode.step(f"{_visible(record)[0]}\0")
    assert not step.done and step.tool_errors == 1, step
    final = episode.step("DONE")
  finally:
    episode.close()
  assert final.done and final.outcome == "wrong" and final.reward == 0.0, final
