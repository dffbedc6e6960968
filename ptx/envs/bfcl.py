"""BFCL, the Berkeley Function Calling Leaderboard: single-turn function calling scored by BFCL's AST rules.

Task records are `{"id", "category", "prompt", "functions", "answer"}`, read
from the data files of the `bfcl-eval` wheel (BFCL v4), which installs
without its dependencies (an API client per vendor, none used here):
`pip install --no-deps bfcl-eval==2026.3.23`. "prompt" is the request (a
live entry's system message before it), "functions" BFCL's function docs
(JSON schemas with BFCL's types: string, integer, float, boolean, array,
tuple, dict, any), "answer" BFCL's possible answer: the expected calls, each
`{name: {argument: [accepted values]}}`, where an accepted "" means the
argument may be left out. Categories: the AST ones in Python (`KNOWN`);
`CATEGORIES`, the non-live ones, are the default.

`BFCLEnv` poses the request with the functions and the call form of the
model's family (`ptx.envs.tools.FORMATS`), and rewards 1.0 when the turn's
calls match the answer by BFCL's AST checker (`check`, the rules of
`bfcl_eval.eval_checker.ast_eval.ast_checker`): the expected number of calls;
each call's function name; every required argument present and no argument
the docs or the answer lack; each value of the documented type (an integer
where a float is documented; a value of the accepted values' own type, which
BFCL reads as a variable); the value among the accepted ones (strings
compared lower-cased without spaces and `,./-_*^`, as are strings in lists
and dicts); an optional argument the answer sets, present; in the parallel
categories, the calls in any order (each expected call takes the first
unmatched call that fits, as BFCL's greedy matching does). A turn whose calls
do not parse is wrong; a turn without calls has no answer. Prose around the
calls is ignored, as BFCL's decoders ignore it.

`BFCLTasks(seed, split)` serves a split's records in a seeded order; the
split is `ptx.data.splits`' hash of the request's text, so a training
stream never holds a held-out request, in any category.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ptx.data import splits
from ptx.envs.base import Outcome, SingleTurn, Step, field
from ptx.envs.tools import FORMATS, Call, parse_calls, render_calls

INSTALL = "pip install --no-deps bfcl-eval==2026.3.23"
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")
KNOWN = CATEGORIES + ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
# BFCL's documented types as Python checks them (ast_checker.PYTHON_TYPE_MAPPING).
_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list, "dict": dict,
          "any": str}
_NESTED = ("array", "tuple")  # types whose items' type is checked too
_IGNORED = re.compile(r"[ ,./\-_*^]")  # what BFCL's standardize_string drops before comparing strings


@functools.cache
def _data_dir() -> pathlib.Path:
  """The data folder of the installed bfcl-eval wheel (never imported: its package imports its dependencies)."""
  spec = importlib.util.find_spec("bfcl_eval")
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(f"BFCL's tasks come from the bfcl-eval wheel's data files; install it with `{INSTALL}` "
                              "(its dependencies are not needed)")
  return pathlib.Path(spec.submodule_search_locations[0]) / "data"


@functools.cache
def _records(category: str) -> tuple[dict[str, Any], ...]:
  """Every record of `category`, in BFCL's order (cached; callers copy)."""
  if category not in KNOWN:
    raise ValueError(f"BFCL category must be one of {KNOWN}, got {category!r}")
  questions, answers = (_data_dir() / f"BFCL_v4_{category}.json", _data_dir() / "possible_answer" /
                        f"BFCL_v4_{category}.json")
  expected = {a["id"]: a["ground_truth"] for a in map(json.loads, answers.read_text().splitlines()) if a}
  out = []
  for line in questions.read_text().splitlines():
    entry = json.loads(line)
    messages = entry["question"][0]  # single-turn categories: one turn of messages
    prompt = "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "user"))
    record = {"id": entry["id"], "category": category, "prompt": prompt, "functions": entry["function"],
              "answer": expected.get(entry["id"])}
    problem = _problem(record)
    if problem:
      raise ValueError(f"{questions}: entry {entry['id']}: {problem}")
    out.append(record)
  return tuple(out)


def load(category: str) -> list[dict[str, Any]]:
  """BFCL's records of one category.

  Args:
    category: one of KNOWN.

  Returns:
    The records, in BFCL's order.

  Raises:
    ModuleNotFoundError: bfcl-eval is not installed (naming the install line).
  """
  return copy.deepcopy(list(_records(category)))


def ground_truth(task: Mapping[str, Any]) -> list[Call]:
  """The record's expected calls, each argument at an accepted value: a required one at its first value other than
  "", an optional one at its first (left out where that is "", its default); arguments the function does not
  document (a few possible answers name an item's field as the call's) are left out."""
  docs = {f["name"]: f.get("parameters", {}) for f in task["functions"]}
  calls = []
  for expected in task["answer"]:
    for name, accepted in expected.items():
      doc = docs.get(name, {})
      properties, required = doc.get("properties", {}), set(doc.get("required", ()))
      arguments = {}
      for key, values in accepted.items():
        chosen = [v for v in values if v != ""] if key in required else values[:1]
        if key in properties and chosen and chosen[0] != "":
          arguments[key] = _first_values(chosen[0]) if isinstance(chosen[0], dict) else _listed(chosen[0])
      calls.append(Call(name, arguments))
  return calls


def _first_values(accepted: Mapping[str, Any]) -> dict[str, Any]:
  """A dict argument at each key's first accepted value (its keys list accepted values, as a call's do; a key
  whose value is not a list holds the value itself)."""
  out = {}
  for key, values in accepted.items():
    value = values[0] if isinstance(values, list) and values else values
    if value != [] and value != "":
      out[key] = _first_values(value) if isinstance(value, dict) else _listed(value)
  return out


def _listed(value: Any) -> Any:
  """A value, the dicts in a list value taken at their first accepted values."""
  return [_first_values(x) if isinstance(x, dict) else _listed(x) for x in value] if isinstance(value, list) else value


def check(task: Mapping[str, Any], calls: Sequence[Call]) -> str:
  """Why `calls` do not answer the record by BFCL's AST rules ("" when they do).

  Args:
    task: a BFCL record.
    calls: the model's calls, parsed (none unreadable).

  Returns:
    "" for a match, else the first reason it is none.
  """
  docs = {f["name"]: f for f in task["functions"]}
  answers = task["answer"]
  if len(calls) != len(answers):
    return f"{len(calls)} calls; the request needs {len(answers)}"
  if "parallel" not in task["category"]:
    ((name, accepted),) = answers[0].items()
    return _check_call(docs[name], calls[0], accepted)
  free = list(range(len(calls)))
  for expected in answers:
    ((name, accepted),) = expected.items()
    reasons = {i: _check_call(docs[name], calls[i], accepted) for i in free}
    # BFCL's greedy matching: the first unmatched call that fits.
    match = next((i for i in free if not reasons[i]), None)
    if match is None:
      return f"no call matches an expected call of {name} (the first tried: {reasons[free[0]]})"
    free.remove(match)
  return ""


def _check_call(doc: Mapping[str, Any], call: Call, accepted: Mapping[str, list]) -> str:
  """Why one call is not the expected call of function `doc` (BFCL's simple_function_checker)."""
  if call.name != doc["name"]:
    return f"called {call.name!r}, not {doc['name']!r}"
  if not isinstance(call.arguments, dict):
    return f"the arguments of {call.name} must be an object, got {type(call.arguments).__name__}"
  properties = doc["parameters"]["properties"]
  missing = [p for p in doc["parameters"].get("required", ()) if p not in call.arguments]
  if missing:
    return f"{call.name} needs argument {missing[0]!r}"
  for p, value in call.arguments.items():
    if p not in properties or p not in accepted:
      return f"{call.name} has no argument {p!r} here"
    reason = _check_value(p, properties[p], value, accepted[p])
    if reason:
      return reason
  unset = [p for p, values in accepted.items() if p not in call.arguments and "" not in values]
  return f"{call.name} needs argument {unset[0]!r} for this request" if unset else ""


def _check_value(name: str, spec: Mapping[str, Any], value: Any, accepted: list) -> str:
  """Why `value` is not an accepted value of argument `name` of type `spec` ("" when it is)."""
  kind = spec["type"]
  expected, items = _TYPES[kind], _TYPES[spec["items"]["type"]] if kind in _NESTED else None
  if kind == "tuple" and type(value) is tuple:
    value = list(value)
  if kind == "float" and type(value) is int:  # Python promotes an int where a float is documented
    value = float(value)
  variable = _variable(value, expected, items, accepted)
  if variable is None:
    return f"argument {name!r} must be {kind}, got {type(value).__name__}"
  if variable:  # BFCL compares a "variable" as it is
    ok = value in accepted
  elif expected is dict:
    ok = _dict_ok(value, accepted)
  elif expected is list and items is dict:
    ok = any(len(value) == len(a) and all(_dict_ok(v, [x]) for v, x in zip(value, a)) for a in accepted)
  elif expected is str:
    ok = _standard(value) in [_standard(a) for a in accepted if type(a) is str]
  elif expected is list:
    ok = [_scalar(v) for v in value] in [[_scalar(x) for x in a] for a in accepted]
  else:
    ok = value in accepted
  return "" if ok else f"argument {name!r} is {value!r}, not one of {accepted}"


def _variable(value: Any, expected: type, items: type | None, accepted: list) -> bool | None:
  """None for a value of the wrong type, else whether BFCL reads it as a variable (BFCL's type_checker).

  A value of the accepted values' type where that is not the documented one counts as a variable name, whatever
  its items; an array's items must each be of the documented item type or of the accepted lists' item type, and an
  accepted "" (the argument may be left out) admits any items, as in BFCL.
  """
  answer_type = next((type(a) for a in accepted if a != ""), None)
  variable = answer_type is not None and answer_type is not expected
  if type(value) is expected:
    if items is None:
      return variable
    for a in accepted:
      if type(a) is not list or all(_item_ok(v, a, items) for v in value):
        return variable
  if answer_type is not None and type(value) is answer_type:
    return True
  return None


def _item_ok(value: Any, accepted: list, expected: type) -> bool:
  answer_type = next((type(a) for a in accepted if a != ""), None)
  return type(value) is expected or (answer_type is not None and type(value) is answer_type)


def _dict_ok(value: Mapping[str, Any], accepted: list) -> bool:
  """Whether a dict matches one accepted dict: its keys accepted, its values among the accepted ones, and every key
  the accepted dict needs present (BFCL's dict_checker)."""
  for a in accepted:
    if a == "":
      continue
    if all(k in a and _scalar(v) in [_scalar(x) for x in a[k]] for k, v in value.items()) and \
        all(k in value or "" in xs for k, xs in a.items()):
      return True
  return False


def _standard(text: str) -> str:
  """BFCL's standardize_string: no spaces or `,./-_*^`, lower case, single quotes as double."""
  return _IGNORED.sub("", text).lower().replace("'", '"')


def _scalar(value: Any) -> Any:
  return _standard(value) if type(value) is str else value


def _problem(task: Mapping[str, Any]) -> str:
  """What makes a record unscorable ("" when nothing)."""
  if not isinstance(task["answer"], list) or not task["answer"]:
    return "no possible answer"
  docs = {f.get("name"): f for f in task["functions"] if isinstance(f, dict)}
  for expected in task["answer"]:
    if not isinstance(expected, dict) or len(expected) != 1:
      return f"an expected call must be one {{name: arguments}} object, got {expected!r}"
    (name,) = expected
    if name not in docs:
      return f"the answer calls {name!r}, which no function doc names"
    properties = docs[name].get("parameters", {}).get("properties")
    if not isinstance(properties, dict):
      return f"the function doc of {name} has no parameters.properties object"
    for p, spec in properties.items():
      kinds = [spec.get("type"), spec.get("items", {}).get("type") if spec.get("type") in _NESTED else "any"]
      if any(k not in _TYPES for k in kinds):
        return f"argument {p!r} of {name} has type {kinds}, not one of {sorted(_TYPES)}"
  return ""


@dataclasses.dataclass(frozen=True)
class BFCLTasks:
  """One split of BFCL's records, record i a pure function of (seed, i, split).

  The train split cycles, each pass over its records in a fresh seeded order; the held-out split is one seeded order
  of its records, and ends.

  Attributes:
    seed: selects the order.
    split: "train" or "held_out" (`ptx.data.splits`, by the request's text).
    categories: the BFCL categories drawn from (of KNOWN).
  """

  seed: int = 0
  split: str = "train"
  categories: tuple[str, ...] = CATEGORIES

  def __post_init__(self):
    splits.check("BFCLTasks", self.split)
    unknown = [c for c in self.categories if c not in KNOWN]
    if unknown or not self.categories:
      raise ValueError(f"BFCLTasks.categories must be some of {KNOWN}, got {self.categories!r}")

  @functools.cached_property
  def _pool(self) -> tuple[dict[str, Any], ...]:
    return tuple(r for c in self.categories for r in _records(c) if splits.split_of(r["prompt"]) == self.split)

  def __len__(self) -> int:
    """The split's records (the train stream cycles past them)."""
    return len(self._pool)

  def __getitem__(self, i: int) -> dict[str, Any]:
    """Record i of the stream (a copy).

    Raises:
      IndexError: past the held-out split's records.
    """
    n = len(self._pool)
    if self.split == "held_out" and not 0 <= i < n:
      raise IndexError(f"BFCLTasks: the held-out split of {self.categories} has {n} records, not {i + 1}")
    epoch, j = divmod(i, n)
    order = np.random.default_rng([self.seed, epoch]).permutation(n)
    return copy.deepcopy(self._pool[order[j]])


@dataclasses.dataclass(frozen=True)
class BFCLEnv:
  """BFCL requests answered in one turn of function calls (see the module docstring).

  Attributes:
    tool_format: the model family's tool-call form (`ptx.envs.tools.FORMATS`; `family_format` picks it).
  """

  name: str = "bfcl"
  max_turns: int = 1
  sandboxed: bool = False
  tool_format: str = "hermes"

  def __post_init__(self):
    if self.tool_format not in FORMATS:
      raise ValueError(f"BFCLEnv.tool_format must be one of {FORMATS}, got {self.tool_format!r}")

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks a BFCL record's fields."""
    field(task, "prompt", str, self.name)
    field(task, "functions", list, self.name)
    field(task, "answer", list, self.name)
    if field(task, "category", str, self.name) not in KNOWN:
      raise ValueError(f"{self.name} task field 'category' must be one of {KNOWN}, got {task['category']!r}")
    problem = _problem(task)
    if problem:
      raise ValueError(f"{self.name} task {task.get('id', '')!r}: {problem}")

  def reset(self, task: Mapping[str, Any]) -> SingleTurn:
    """Starts an episode for a BFCL record: the request, the function docs, and how to call them."""
    self.validate(task)
    return SingleTurn(self.first_prompt(task), lambda action: self._score(task, action))

  def first_prompt(self, task: Mapping[str, Any]) -> str:
    """The episode's prompt: the request, then the functions as JSON, then how this environment's form writes
    calls."""
    first = task["functions"][0]
    example = Call(first["name"], {p: "..." for p in first["parameters"].get("required", [])})
    docs = "\n".join(json.dumps(f) for f in task["functions"])
    return (f"{task['prompt']}\n\nFunctions:\n{docs}\n\nReply with the function calls the request needs, one or "
            f"more, each with literal argument values, in this form (two calls shown):\n"
            f"{render_calls(self.tool_format, [example, example])}")

  def demonstration(self, task: Mapping[str, Any]) -> list[dict[str, str]]:
    """The request answered right, as chat messages: the episode's prompt, then the expected calls
    (`ground_truth`) in this environment's form.

    Raises:
      ValueError: for a record `validate` refuses, or whose expected calls this environment does not score 1.
    """
    return self.reset(task).demonstration(render_calls(self.tool_format, ground_truth(task)),
                                          f"{self.name} task {task.get('id', '')!r}: its expected calls score")

  def _score(self, task: Mapping[str, Any], action: str) -> Step:
    calls = parse_calls(action, self.tool_format)
    if not calls:
      return Step.final(Outcome.NO_ANSWER, f"no {self.tool_format} tool call found")
    errors = [c.error for c in calls if c.error]
    if errors:
      return Step.final(Outcome.WRONG, errors[0], tool_calls=len(calls), tool_errors=len(errors))
    reason = check(task, calls)
    if reason:
      return Step.final(Outcome.WRONG, reason, tool_calls=len(calls))
    return Step.final(Outcome.OK, f"{len(calls)} calls match BFCL's answer", tool_calls=len(calls))
