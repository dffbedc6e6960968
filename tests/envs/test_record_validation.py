"""`Environment.validate`: a record's fields checked by `reset`'s rules, with no episode started and no code run."""

import pytest

from ptx.data.arithmetic import ArithmeticTask
from ptx.data.tokenizer import ByteTokenizer
from ptx.envs import calculator, countdown, docqa, exact_answer, needle, python_tests, shell, terminal
from ptx.sandbox import run as sandbox

ENVS = {"exact_answer": exact_answer.ExactAnswerEnv(), "countdown": countdown.CountdownEnv(),
        "needle": needle.NeedleEnv(), "calculator": calculator.CalculatorEnv(), "shell": shell.ShellEnv(),
        "docqa": docqa.DocQAEnv(ByteTokenizer()), "code": python_tests.PythonTestsEnv()}
BUILT_IN = {"exact_answer": ArithmeticTask(0, 2), "countdown": countdown.CountdownTask(0),
            "needle": needle.NeedleTask(0, lengths=(50,)), "calculator": calculator.CalculatorTasks(0),
            "shell": terminal.TerminalTasks(0), "docqa": docqa.DocQATasks(0)}
CODE = {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3"]}
SHELL = {"prompt": "Fix it.", "files": {"a.py": "x = 1\n"}, "check": "true", "setup": "touch ran"}


@pytest.fixture
def no_sandbox(monkeypatch):
  """Every way into the sandbox fails the test: validation must run no code."""
  for name in ("run", "backend"):
    monkeypatch.setattr(sandbox, name, lambda *a, **k: pytest.fail("validation ran something in the sandbox"))


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_built_in_records_pass(name, no_sandbox):
  for i in range(3):
    ENVS[name].validate(BUILT_IN[name][i])


def test_code_and_shell_records_pass_without_running_their_tests_or_set_up(no_sandbox):
  ENVS["code"].validate(CODE)
  ENVS["shell"].validate(SHELL)
  ENVS["shell"].validate({**SHELL, "max_turns": 8, "check_files": {"t.sh": "exit 0\n"}})


@pytest.mark.parametrize("name,change,error", [
    ("exact_answer", {"answer": [2]}, "exact_answer task field 'answer' must be str, int or float, got list"),
    ("exact_answer", {"prompt": None}, "exact_answer task field 'prompt' must be a string or chat messages (a list of "
                                       "role/content objects), got NoneType"),
    ("calculator", {"prompt": [{"role": "system", "content": "x"}]},
     "calculator task field 'prompt': an episode starts from one user turn"),
    ("countdown", {"numbers": [1, "2"]}, "countdown task field 'numbers' must hold ints only"),
    ("needle", {"answer": 1.5}, "needle task field 'answer' must be str or int, got float"),
    ("calculator", {"answer": "12"}, "calculator task field 'answer' must be int, got str"),
    ("code", {"tests": []}, "python_tests task field 'tests' must be a str or a non-empty list of str"),
    ("code", {"tests": "# nothing"}, "python_tests task field 'tests': test 1 is empty"),
    ("code", {"tests": ["assert True", "assert ("]}, "python_tests task field 'tests': test 2 is not valid Python"),
    ("shell", {"files": ["a.py"]}, "shell task field 'files' must be dict, got list"),
    ("shell", {"files": {"a.py": 1}}, "shell task field 'files' must map paths to text; 'a.py' is int"),
    ("shell", {"files": {"../a.py": ""}}, "shell task field 'files': Workspace file name must stay inside"),
    ("shell", {"check_files": {"t.sh": None}}, "shell task field 'check_files' must map paths to text"),
    ("shell", {"max_turns": 9}, "shell task field 'max_turns' must be in 1..8, got 9"),
    ("shell", {"max_turns": "3"}, "shell task field 'max_turns' must be in 1..8, got '3'"),
    ("shell", {"setup": ["make"]}, "shell task field 'setup' must be a str, got list"),
    ("docqa", {"document": "\n\n \n"}, "docqa task field 'document' has no passages"),
])
def test_a_bad_field_is_named_alike_by_validate_and_reset(name, change, error, no_sandbox):
  good = {"code": CODE, "shell": SHELL}.get(name) or BUILT_IN[name][0]
  record = {**good, **change}
  with pytest.raises(ValueError) as validated:
    ENVS[name].validate(record)
  assert str(validated.value).startswith(error)
  with pytest.raises(ValueError) as reset:  # the same rules refuse it before an episode needs the sandbox
    ENVS[name].reset(record)
  assert str(reset.value) == str(validated.value)
