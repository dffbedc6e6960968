"""Python code against unit tests: the solution and the tests run in separate sandboxes.

Task records are `{"prompt": str | chat messages, "tests": str | list[str]}`:
the tests are Python statements (usually asserts, MBPP/HumanEval style)
written as if after `from solution import *`; each element of a list is one
test, a str is one test. The model's code is the last fenced code block of
its output (the whole output when it has none). Two optional fields serve
completion-style benchmarks (`ptx.envs.humaneval`): "stop", strings at the
first of which the output is cut before its code is taken (a completion runs
on past its function), and "prefix", source put before the model's code (the
function's signature and docstring the model continued, or a prompt's imports
and helpers). Both come from the task, never from the model.

Grading. The code runs as `solution.py` under `solution_server.py`, in a
sandbox of its own. The tests run under `code_grader.py`, in a fork of the
process's grading server (`ptx.sandbox.fork_server`): one long-lived sandbox whose
workspace holds only the grader and `plain_data.py`, and which no solution's
sandbox can reach; the tests come on the fork's stdin and never reach the
solution's sandbox. The two talk over a pair
of pipes: the grader calls the solution's functions, classes and methods,
and only plain data (`ptx.verifiers.inside.plain_data`: exact builtin types) crosses;
anything else stays in the solution's process and the grader holds a handle
to it. Before the tests run, `==`, `!=`, `in` and `not in` in them are
rewritten to `plain_data.same`, an equality that requires identical types
all the way down (True != 1, 1 != 1.0, (1,) != [1]; nan equals nan), and
method calls to one request each. Every request has a deadline, the end of the
env's `limits.timeout_s` for all tests; the sandboxes get `_GRACE_S` more, so the
grader always reports. The grader prints one JSON verdict; the reward is 1.0
when every test ran to its end, read from that verdict and never from an
exit status the solution controls. A grader that gives no verdict is an
INFRA_ERROR.

Threat model. The solution is adversarial; the tests, the grader and the
sandbox are trusted (so gradings may share the grading server's sandbox).
Defended: exiting early (`os._exit(0)`, SystemExit at import or in a call)
or crashing: the requests fail, so the tests fail;
objects with a planted `__eq__`, `__bool__` or `__getattr__`, subclasses of
builtins, mocks: they are not plain data, so they stay behind as handles
whose equality is identity; patching builtins, AssertionError, sys hooks or
atexit, or plain_data and the server themselves: that changes only the
solution's own process; reading the tests from disk: they are not in its
sandbox (nor on the grader's disk); printing a fake verdict or writing
forged bytes to the pipes: the verdict comes from the grader's stdout and
carries a nonce the solution never sees, and every reply is decoded as
bounded plain data and checked against its request; signalling or reading
the grader: the solution's sandbox keeps it apart; shadowing builtins or patching a
module the tests use through `import *`: names of builtins are not bound, and
modules are the grader's own; True for 1 or 3.0 for 3: strict equality;
hanging: the deadline. Not defended: weak tests (a solution may special-case
the arguments it is called with, and a test that catches every exception
passes whatever exception the solution raises). Keeping runs apart is the
sandbox's part: the bwrap backend does, with or without root; the rlimits
backend without root runs both as the caller's uid, and then the solution
can see and signal the grader's process (see `ptx.sandbox.run`).

Limits of the design: the tests cannot pass the solution callbacks (lambdas,
their own objects), iterate solution objects (generators) or set their
attributes; names of builtins the solution defines are not bound (a test's
`len` is the real one); a test's own `import solution` sees the exported
names only.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import secrets
import threading
from collections.abc import Mapping
from typing import Any

from ptx.sandbox import fork_server, run as sandbox

from ptx.verifiers.inside import plain_data
from ptx.envs.base import Outcome, SingleTurn, Step, field, from_sandbox, prompt_text

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "verifiers" / "inside"  # grader, server, plain_data
# Start-up of both interpreters and the verdict, on a loaded machine; it only
# matters when a run is stuck, since the grader stops itself at the deadline.
_GRACE_S = 5.0
_KINDS = ("wrong", "timeout", "gone", "protocol")  # the grader's reasons for a failed test
_STRICT = {ast.Eq: "_ptx_eq", ast.NotEq: "_ptx_eq", ast.In: "_ptx_in", ast.NotIn: "_ptx_in"}


def extract_code(text: str) -> str:
  """Returns the last fenced code block of `text`, or all of it when there is none.

  Args:
    text: the model's output.

  Returns:
    Python source.
  """
  blocks = _FENCE.findall(text)
  return blocks[-1] if blocks else text


def _last_line(text: str) -> str:
  lines = [line for line in text.strip().splitlines() if line.strip()]
  return "".join(c if c.isprintable() else "?" for c in lines[-1][:200]) if lines else ""


class _Strict(ast.NodeTransformer):
  """Rewrites comparisons and method calls in a test to the grader's helpers (see code_grader.py)."""

  def __init__(self):
    self.temporaries = 0

  def visit_Compare(self, node: ast.Compare) -> ast.AST:
    self.generic_visit(node)
    if not any(type(op) in _STRICT for op in node.ops):
      return node
    operands, parts = [node.left, *node.comparators], []
    left = operands[0]
    for i, op in enumerate(node.ops):
      right = operands[i + 1]
      if i < len(node.ops) - 1:  # a middle operand of a chain: evaluated once, used twice
        name = f"_ptx_t{self.temporaries}"
        self.temporaries += 1
        parts.append(_compare(op, left, ast.NamedExpr(ast.Name(name, ast.Store()), right)))
        left = ast.Name(name, ast.Load())
      else:
        parts.append(_compare(op, left, right))
    return parts[0] if len(parts) == 1 else ast.BoolOp(ast.And(), parts)

  def visit_Call(self, node: ast.Call) -> ast.AST:
    self.generic_visit(node)
    func = node.func
    # Private names (`self.__x()`) are mangled by the compiler: left as they are.
    if not isinstance(func, ast.Attribute) or (func.attr.startswith("__") and not func.attr.endswith("__")):
      return node
    return ast.Call(ast.Name("_ptx_method", ast.Load()), [func.value, ast.Constant(func.attr), *node.args],
                    node.keywords)


def _compare(op: ast.cmpop, left: ast.expr, right: ast.expr) -> ast.expr:
  helper = _STRICT.get(type(op))
  if helper is None:
    return ast.Compare(left, [op], [right])
  call = ast.Call(ast.Name(helper, ast.Load()), [left, right], [])
  return ast.UnaryOp(ast.Not(), call) if isinstance(op, (ast.NotEq, ast.NotIn)) else call


def _rewrite(tests: str | list, env: str) -> tuple[str, ...]:
  """The tests as the grader runs them (parsed and compiled, never run); raises ValueError naming the field for a
  test that is empty or not valid Python, or tests too large for the grader."""
  tests = [tests] if isinstance(tests, str) else tests
  if not tests or not all(isinstance(t, str) for t in tests):
    raise ValueError(f"{env} task field 'tests' must be a str or a non-empty list of str")
  sources = []
  for i, test in enumerate(tests):
    try:
      tree = ast.parse(test)
      if not tree.body:  # a test without a statement would pass any solution
        raise ValueError(f"{env} task field 'tests': test {i + 1} is empty")
      sources.append(ast.unparse(ast.fix_missing_locations(_Strict().visit(tree))))
      compile(sources[-1], f"<test {i + 1}>", "exec", dont_inherit=True)
    except SyntaxError as e:
      raise ValueError(f"{env} task field 'tests': test {i + 1} is not valid Python (once rewritten for strict "
                       f"equality): {e}") from None
  try:
    plain_data.encode(("", sources, 0.0))  # too large for the grader's stdin: refused here, not at scoring
  except plain_data.TooLarge as e:
    raise ValueError(f"{env} task field 'tests' is too large for the grader: {e}") from None
  return tuple(sources)


@functools.cache
def _script(name: str) -> str:
  return (_SCRIPTS / name).read_text()


@functools.cache
def _grader(python: str) -> fork_server.ForkServer:
  """The process's grader: one long-lived sandbox per interpreter, a fork of it per solution graded."""
  scripts = {"code_grader.py": _script("code_grader.py"), "plain_data.py": _script("plain_data.py")}
  return fork_server.ForkServer("code_grader.py", scripts, python=python)


@dataclasses.dataclass(frozen=True)
class PythonTestsEnv:
  """Single-turn: the model writes code; the task's tests judge it from another sandbox.

  Attributes:
    python: the interpreter, looked up on the sandbox PATH.
    limits: the solution's sandbox limits; `timeout_s` is also the tests'
      budget, all of them together.
  """

  name: str = "python_tests"
  max_turns: int = 1
  python: str = "python3"
  limits: sandbox.Limits = sandbox.Limits(timeout_s=10.0, cpu_s=10, memory_bytes=1 << 30)
  sandboxed: bool = True

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks a `{"prompt", "tests"}` record's fields: the tests are parsed, not run."""
    self._sources(task)
    self._completion_fields(task)

  def reset(self, task: Mapping[str, Any]) -> SingleTurn:
    """Starts an episode for a `{"prompt", "tests"}` record (optional "prefix" and "stop")."""
    sources = self._sources(task)
    prefix, stop = self._completion_fields(task)
    sandbox.backend()  # refuses here, naming the fix, when no sandbox works on this host
    shown = [task["tests"]] if isinstance(task["tests"], str) else task["tests"]
    return SingleTurn(prompt_text(task, self.name), lambda action: self._score(action, sources, shown, prefix, stop))

  def _sources(self, task: Mapping[str, Any]) -> tuple[str, ...]:
    """The record's tests as the grader runs them, its fields checked."""
    prompt_text(task, self.name)
    return _rewrite(field(task, "tests", (str, list), self.name), self.name)

  def _completion_fields(self, task: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """The record's optional "prefix" ("" when absent) and "stop" strings (none when absent), checked."""
    prefix = field(task, "prefix", str, self.name) if "prefix" in task else ""
    stop = field(task, "stop", list, self.name) if "stop" in task else []
    if not all(isinstance(s, str) and s for s in stop):
      raise ValueError(f"{self.name} task field 'stop' must be a list of non-empty str, got {stop!r}")
    return prefix, tuple(stop)

  def _score(self, action: str, sources: tuple[str, ...], shown: list[str], prefix: str,
             stop: tuple[str, ...]) -> Step:
    cut = min((i for i in (action.find(s) for s in stop) if i >= 0), default=len(action))
    code = extract_code(action[:cut])
    if not code.strip():
      return Step.final(Outcome.NO_ANSWER, "no code")
    nonce = secrets.token_hex(16)
    solution, grader = self._run_both(prefix + code, plain_data.encode((nonce, sources, self.limits.timeout_s)))
    return _judge(grader, solution, nonce, shown)

  def _run_both(self, code: str, grader_input: bytes) -> tuple[sandbox.SandboxResult, sandbox.SandboxResult]:
    """Runs the solution's server (in a thread) and the grader side by side, linked by two pipes."""
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    total_s = self.limits.timeout_s + _GRACE_S
    done: dict[str, Any] = {}

    def serve() -> None:
      try:
        done["result"] = sandbox.run(
            [self.python, "-I", "-S", "solution_server.py", str(request_r), str(reply_w)],
            limits=dataclasses.replace(self.limits, timeout_s=total_s), pass_fds=(request_r, reply_w),
            files={"solution.py": code, "solution_server.py": _script("solution_server.py"),
                   "plain_data.py": _script("plain_data.py")})
      except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
        done["error"] = e

    thread = threading.Thread(target=serve, name="python_tests solution", daemon=True)
    try:
      thread.start()
    except BaseException:
      for fd in (request_r, request_w, reply_r, reply_w):
        os.close(fd)
      raise
    try:
      # CPU seconds past the wall clock: the grader's own alarm always comes first.
      grader = _grader(self.python).run(
          stdin=grader_input, pass_fds=(request_w, reply_r),
          limits=dataclasses.replace(self.limits, timeout_s=total_s, cpu_s=math.ceil(total_s) + 1))
    finally:
      thread.join()
    if "error" in done:
      raise done["error"]
    return done["result"], grader


def _verdict(grader: sandbox.SandboxResult, nonce: str, total: int) -> dict | None:
  """The grader's verdict line, when it exited cleanly and printed exactly one well-formed one."""
  lines = grader.stdout_text.splitlines()
  if grader.outcome != sandbox.Outcome.OK or len(lines) != 1:
    return None
  try:
    verdict = json.loads(lines[0])
  except ValueError:
    return None
  if not isinstance(verdict, dict) or verdict.get("nonce") != nonce or verdict.get("total") != total:
    return None
  passed, failed = verdict.get("passed"), verdict.get("failed")
  if failed is None:
    return verdict if type(passed) is int and passed == total else None
  ok = (type(passed) is int and type(failed) is int and 0 <= passed < total and 0 <= failed < total
        and verdict.get("kind") in _KINDS and isinstance(verdict.get("failure"), str))
  return verdict if ok else None


def _judge(grader: sandbox.SandboxResult, solution: sandbox.SandboxResult, nonce: str, tests: list[str]) -> Step:
  """The episode's step from the grader's verdict and how the solution's run ended."""
  verdict = _verdict(grader, nonce, len(tests))
  if verdict is None:
    return Step.final(Outcome.INFRA_ERROR,
                      f"the grader gave no verdict ({grader.reason}): {_last_line(grader.stderr_text)}".rstrip(": "))
  if verdict["failed"] is None:
    return Step.final(Outcome.OK, f"all {len(tests)} tests passed")
  i, kind = verdict["failed"], verdict["kind"]
  reason = f"test {i + 1} of {len(tests)} ({_last_line(tests[i])[:80]}): {verdict['failure']}"
  outcome = Outcome.TIMEOUT if kind == "timeout" else Outcome.WRONG
  if kind in ("gone", "protocol"):
    reason += f"; the solution's run: {solution.reason} {_last_line(solution.stderr_text)}".rstrip()
    if solution.outcome in (sandbox.Outcome.TIMEOUT, sandbox.Outcome.CRASHED, sandbox.Outcome.LIMIT,
                            sandbox.Outcome.INFRA_ERROR):
      outcome = from_sandbox(solution.outcome)
  return Step.final(outcome, reason)
