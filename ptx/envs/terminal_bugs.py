"""Bug families for terminal tasks: a small project with one bug, its fix, and inputs the model never sees.

Each family is a builder `(theme, rng) -> Project` and four themes (file,
function, column and message names); `FAMILIES` maps a family's name to
both, and `ptx.envs.terminal` turns a Project into a `ShellEnv`
record whose hidden check runs the fixed project against the model's. A
builder writes the fixed project and makes the bug from it by replacing the
fix's text (it must occur once), so the two differ by exactly the bug; its
data and hidden inputs are drawn so that the bug always shows (the boundary
value a comparison gets wrong, numbers whose text order is not their order,
a repeated group, a word-separating run of whitespace).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

_CASES = 3  # hidden runs per task (new data each), or hidden calls per module task
_WORDS = ("amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris", "juniper", "kestrel",
          "lotus", "maple", "nectar", "onyx", "pebble", "quartz", "raven", "sage", "tundra", "umber", "willow")


@dataclasses.dataclass(frozen=True)
class Project:
  """A generated task before it becomes a record: what the model sees, the fix, and the hidden cases."""

  prompt: str
  files: dict[str, str]  # the workspace as the model finds it
  fixed: dict[str, str]  # the files the fix rewrites, as they should be
  cases: list[tuple[list[str], dict[str, str]]]  # hidden runs: argv, and the input files written first


def _swap(text: str, pairs: list[tuple[str, str]]) -> str:
  """`text` with each (right, wrong) pair's right part replaced: the bug."""
  for right, wrong in pairs:
    if text.count(right) != 1:
      raise ValueError(f"a bug family's fix {right!r} must occur exactly once in {text!r}")
    text = text.replace(right, wrong)
  return text


def _words(rng, n: int) -> list[str]:
  return [_WORDS[k] for k in rng.choice(len(_WORDS), size=n, replace=False)]


def _program(rng, *, files: dict[str, str], path: str, bug: list[tuple[str, str]], command: str, data: str,
             draw: Callable, output: Callable, symptom: str, ask: str) -> Project:
  """A program that reads the file `data` and prints; hidden cases are fresh data files.

  Args:
    files: the fixed project, without the data file.
    path: the file the bug is in (`bug`: its (right, wrong) pairs).
    draw: rng -> (the data file's text, the value `output` turns into the expected stdout).
  """
  text, value = draw(rng)
  initial = {**files, data: text, path: _swap(files[path], bug)}
  prompt = f"Running `{command}` {symptom}. For the current {data} it should print:\n```\n{output(value)}```\n{ask}"
  return Project(prompt, initial, {path: files[path]}, [(command.split(), {data: draw(rng)[0]}) for _ in range(_CASES)])


def _module(*, module: str, func: str, code: str, bug: list[tuple[str, str]], visible: list[tuple[str, Any]],
            hidden: list[str], ask: str) -> Project:
  """A module with a visible failing unit test; the hidden case prints, as JSON, more calls of `func`.

  Args:
    visible: (call, expected value) pairs the visible test asserts.
    hidden: calls the hidden case prints, one line each.
  """
  asserts = "".join(f"        self.assertEqual({call}, {want!r})\n" for call, want in visible)
  test = (f"import unittest\n\nfrom {module} import {func}\n\n\nclass Test{func.title().replace('_', '')}"
          f"(unittest.TestCase):\n    def test_examples(self):\n{asserts}\n\nif __name__ == \"__main__\":\n"
          f"    unittest.main()\n")
  driver = f"import json\n\nfrom {module} import {func}\n\n" + "".join(f"print(json.dumps({c}))\n" for c in hidden)
  prompt = f"Running `python3 test_{module}.py` fails. {ask} Fix {module}.py; do not change the tests."
  files = {f"{module}.py": _swap(code, bug), f"test_{module}.py": test}
  return Project(prompt, files, {f"{module}.py": code}, [(["python3", "hidden_case.py"], {"hidden_case.py": driver})])


def _csv(header: str, rows: list[tuple]) -> str:
  return header + "\n" + "".join(",".join(map(str, row)) + "\n" for row in rows)


def _lines(values) -> str:
  return "".join(f"{v}\n" for v in values)


def _skip_first(theme, rng) -> Project:
  prog, data, key, col, label = theme
  code = (f'import csv\n\nwith open("{data}") as f:\n    rows = list(csv.DictReader(f))\ntotal = 0\n'
          f'for i in range(len(rows)):\n    total += int(rows[i]["{col}"])\nprint("{label}:", total)\n')

  def draw(rng):
    rows = [(w, int(rng.integers(10, 1000))) for w in _words(rng, int(rng.integers(4, 8)))]
    return _csv(f"{key},{col}", rows), sum(v for _, v in rows)

  return _program(rng, files={prog: code}, path=prog, bug=[("range(len(rows))", "range(1, len(rows))")],
                  command=f"python3 {prog}", data=data, draw=draw, output=lambda t: f"{label}: {t}\n",
                  symptom="prints the wrong total", ask=f"Fix {prog} so that it prints the right total for any {data}.")


_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def _comparison(theme, rng) -> Project:
  module, func, const, doc, right, wrong = theme
  limit = int(rng.integers(30, 90))
  code = (f'{const} = {limit}\n\n\ndef {func}(values):\n    """How many of the values are {doc} {const}."""\n'
          f'    return sum(1 for v in values if v {right} {const})\n')

  def values():  # the limit itself among them: where the operators differ
    near = rng.integers(limit - 20, limit + 21, size=int(rng.integers(3, 6)))
    return [int(v) for v in rng.permutation([limit, *near])]

  return _module(module=module, func=func, code=code, bug=[(f"v {right} {const}", f"v {wrong} {const}")],
                 visible=[(f"{func}({xs})", sum(_OPS[right](x, limit) for x in xs)) for xs in (values(), values())],
                 hidden=[f"{func}({values()})" for _ in range(_CASES)],
                 ask=f"{func} must count the values that are {doc} {const}.")


def _mutable_default(theme, rng) -> Project:
  module, func, item, items = theme
  code = (f'def {func}({item}, {items}=None):\n    """Returns {items} with {item} appended (a new list when no '
          f'{items} are given)."""\n    if {items} is None:\n        {items} = []\n    {items}.append({item})\n'
          f'    return {items}\n')
  bug = [(f"{items}=None", f"{items}=[]"), (f"    if {items} is None:\n        {items} = []\n", "")]
  a, b, c, d, e, f, g, h = _words(rng, 8)
  return _module(module=module, func=func, code=code, bug=bug,
                 visible=[(f"{func}({a!r})", [a]), (f"{func}({b!r}, [{c!r}])", [c, b]), (f"{func}({d!r})", [d])],
                 hidden=[f"{func}({e!r})", f"{func}({f!r}, [{g!r}])", f"{func}({h!r})"],
                 ask=f"{func} must return a new list each time it is called without {items}.")


def _top_numbers(rng) -> list[int]:
  """Numbers whose order as text differs from their order as numbers (one of 100-199, one of 20-99)."""
  rest = rng.integers(2, 200, size=int(rng.integers(4, 8)))
  return [int(v) for v in rng.permutation([int(rng.integers(100, 200)), int(rng.integers(20, 100)), *rest])]


def _str_sort(theme, rng) -> Project:
  prog, data, label = theme
  code = (f'with open("{data}") as f:\n    values = [int(line) for line in f if line.strip()]\n'
          f'values.sort(reverse=True)\nprint("{label}:", ", ".join(str(v) for v in values[:3]))\n')
  return _program(rng, files={prog: code}, path=prog, bug=[("[int(line) for", "[line.strip() for")],
                  command=f"python3 {prog}", data=data, draw=lambda rng: (_lines(v := _top_numbers(rng)), v),
                  output=lambda v: f"{label}: {', '.join(map(str, sorted(v, reverse=True)[:3]))}\n",
                  symptom="prints the wrong three numbers",
                  ask=f"Fix {prog} so that it prints the three largest numbers of any {data}, largest first.")


def _missing_return(theme, rng) -> Project:
  prog, func, data, label = theme
  code = (f"def {func}(values):\n    total = sum(values)\n    return total / len(values)\n\n\n"
          f'with open("{data}") as f:\n    values = [float(line) for line in f if line.strip()]\n'
          f'print("{label}: %.1f" % {func}(values))\n')

  def draw(rng):
    text = _lines(f"{v / 10:.1f}" for v in rng.integers(100, 1000, size=int(rng.integers(4, 9))))
    values = [float(line) for line in text.split()]
    return text, sum(values) / len(values)

  return _program(rng, files={prog: code}, path=prog, bug=[("    return total / len", "    total / len")],
                  command=f"python3 {prog}", data=data, draw=draw, output=lambda m: f"{label}: {m:.1f}\n",
                  symptom="fails with a TypeError", ask=f"Fix {prog} so that it prints the mean of any {data}.")


def _wrong_path(theme, rng) -> Project:
  prog, folder, wrong, name, label = theme
  code = (f'import os\n\nPATH = os.path.join("{folder}", "{name}")\n\nwith open(PATH) as f:\n'
          f'    names = sorted(line.strip() for line in f if line.strip())\n'
          f'print("{label}: %d (%s)" % (len(names), ", ".join(names)))\n')
  return _program(rng, files={prog: code}, path=prog, bug=[(f'("{folder}",', f'("{wrong}",')],
                  command=f"python3 {prog}", data=f"{folder}/{name}",
                  draw=lambda rng: (_lines(ws := _words(rng, int(rng.integers(3, 7)))), sorted(ws)),
                  output=lambda ws: f"{label}: {len(ws)} ({', '.join(ws)})\n", symptom="fails with FileNotFoundError",
                  ask=f"Its input is {folder}/{name}; leave it there (new lists will be written to that file). "
                      f"Fix {prog}.")


def _config_value(theme, rng) -> Project:
  prog, config, key, what, sign = theme
  good, bad = (int(v) for v in rng.choice(np.arange(3, 30), size=2, replace=False))
  code = (f'import csv\nimport json\n\nwith open("{config}") as f:\n    config = json.load(f)\nwith open("items.csv") '
          f'as f:\n    subtotal = sum(int(row["price"]) * int(row["quantity"]) for row in csv.DictReader(f))\n'
          f'print("Total: %.2f %s" % (subtotal * (100 {sign} config["{key}"]) / 100, config["currency"]))\n')

  def draw(rng):
    rows = [(w, int(rng.integers(2, 200)), int(rng.integers(1, 6))) for w in _words(rng, int(rng.integers(2, 6)))]
    return _csv("item,price,quantity", rows), sum(p * q for _, p, q in rows)

  settings = json.dumps({"currency": "EUR", key: good}, indent=2) + "\n"
  rate = 100 + good if sign == "+" else 100 - good  # the program's (100 {sign} percent), in the same float steps
  return _program(rng, files={prog: code, config: settings}, path=config, bug=[(f": {good}\n", f": {bad}\n")],
                  command=f"python3 {prog}", data="items.csv", draw=draw,
                  output=lambda s: f"Total: {s * rate / 100:.2f} EUR\n",
                  symptom=f"prints the wrong total: our {what} is {good}%",
                  ask=f"Fix the configuration so that {prog} uses a {what} of {good}%.")


def _unit_test(theme, rng) -> Project:
  module, func, params, doc, body, bug, arguments, reference = theme
  code = f'def {func}({params}):\n    """{doc}"""\n    return {body}\n'
  call = lambda args: f"{func}({', '.join(map(repr, args))})"  # noqa: E731
  return _module(module=module, func=func, code=code, bug=[bug],
                 visible=[(call(args), reference(*args)) for args in arguments(rng)],
                 hidden=[call(args) for args in arguments(rng)], ask=f"{func} must do what its docstring says.")


def _texts(rng) -> list[tuple]:
  spaces = ("  ", "\n", "\t", " \n ")
  return [(" ".join(_words(rng, 2)) + spaces[int(rng.integers(4))] + " ".join(_words(rng, int(rng.integers(1, 4)))),)
          for _ in range(_CASES)]


def _years(rng) -> list[tuple]:
  return [(400 * int(rng.integers(3, 6)),), (100 * int(rng.choice([17, 18, 19, 21, 22])),),
          (4 * int(rng.integers(450, 520)),), (4 * int(rng.integers(450, 520)) + 1,)]


def _clamps(rng) -> list[tuple]:
  lo, hi = sorted(int(v) for v in rng.choice(100, size=2, replace=False))
  return [(lo - int(rng.integers(1, 9)), lo, hi), (int(rng.integers(lo, hi + 1)), lo, hi), (hi + 3, lo, hi)]


def _names(rng) -> list[tuple]:
  return [(" ".join(_words(rng, int(rng.integers(2, 4)))),) for _ in range(_CASES)]


def _shell_script(theme, rng) -> Project:
  script, data, comment, body, bug, draw, output = theme
  return _program(rng, files={script: f"#!/bin/sh\n# {comment}\n{body}"}, path=script, bug=[bug],
                  command=f"sh {script} {data}", data=data, draw=draw, output=output, symptom="prints the wrong result",
                  ask=f"Fix {script} (it must keep working on any {data}): {comment[0].lower()}{comment[1:]}")


def _log(rng):
  levels = ["ERROR", "error", *rng.choice(["INFO", "WARN", "Error", "error"], size=int(rng.integers(3, 7)))]
  lines = [f"{level} {w} {int(rng.integers(100, 999))}" for level, w in zip(rng.permutation(levels), _words(rng, 9))]
  return _lines(lines), sum("error" in line.lower() for line in lines)


def _numbers(rng):
  values = [int(v) for v in rng.integers(1, 100, size=int(rng.integers(3, 8)))]
  return _lines(values), values


def _group_totals(theme, rng) -> Project:
  prog, data, key, col = theme
  code = (f'import csv\n\ntotals = {{}}\nwith open("{data}") as f:\n    for row in csv.DictReader(f):\n'
          f'        totals[row["{key}"]] = totals.get(row["{key}"], 0) + int(row["{col}"])\n'
          f'for name in sorted(totals):\n    print(name, totals[name])\n')

  def draw(rng):
    groups = _words(rng, 3)
    rows = [(g, int(rng.integers(1, 500))) for g in [*groups, *rng.choice(groups, size=int(rng.integers(2, 5)))]]
    rows = [rows[k] for k in rng.permutation(len(rows))]
    return _csv(f"{key},{col}", rows), {g: sum(v for h, v in rows if h == g) for g in groups}

  return _program(rng, files={prog: code}, path=prog,
                  bug=[(f'totals.get(row["{key}"], 0) + int(row["{col}"])', f'int(row["{col}"])')],
                  command=f"python3 {prog}", data=data, draw=draw,
                  output=lambda t: "".join(f"{g} {t[g]}\n" for g in sorted(t)), symptom="prints the wrong totals",
                  ask=f"Fix {prog} so that it prints the total {col} of each {key} in any {data}.")


def _swapped_args(theme, rng) -> Project:
  prog, data, yes, no, label = theme
  code = (f"def percent(part, whole):\n    return round(100 * part / whole, 1)\n\n\nwith open(\"{data}\") as f:\n"
          f"    marks = [line.strip() for line in f if line.strip()]\n"
          f'print("{label}: %s%%" % percent(marks.count("{yes}"), len(marks)))\n')

  def draw(rng):
    marks = [yes, no, *rng.choice([yes, no], size=int(rng.integers(2, 9)))]
    marks = [str(m) for m in rng.permutation(marks)]
    return _lines(marks), round(100 * marks.count(yes) / len(marks), 1)

  return _program(rng, files={prog: code}, path=prog,
                  bug=[(f'percent(marks.count("{yes}"), len(marks))', f'percent(len(marks), marks.count("{yes}"))')],
                  command=f"python3 {prog}", data=data, draw=draw, output=lambda p: f"{label}: {p}%\n",
                  symptom="prints a percentage over 100", ask=f"Fix {prog}: it must print the share of {yes!r} lines.")


FAMILIES: dict[str, tuple[Callable[[tuple, np.random.Generator], Project], tuple[tuple, ...]]] = {
    "skip_first": (_skip_first, (
        ("report.py", "sales.csv", "region", "amount", "Total sales"),
        ("tally.py", "orders.csv", "customer", "quantity", "Items ordered"),
        ("costs.py", "expenses.csv", "category", "cost", "Total cost"),
        ("traffic.py", "visits.csv", "page", "visitors", "Visitors"))),
    "comparison": (_comparison, (
        ("grades", "count_passing", "PASS_MARK", "at or above", ">=", ">"),
        ("speed", "count_speeding", "SPEED_LIMIT", "above", ">", ">="),
        ("stock", "count_low", "REORDER_LEVEL", "at or below", "<=", "<"),
        ("prices", "count_cheap", "PRICE_CAP", "below", "<", "<="))),
    "mutable_default": (_mutable_default, (
        ("tags", "add_tag", "tag", "tags"), ("basket", "add_item", "item", "items"),
        ("playlist", "add_song", "song", "songs"), ("guests", "invite", "name", "names"))),
    "str_sort": (_str_sort, (
        ("top.py", "scores.txt", "Top scores"), ("largest.py", "sizes.txt", "Largest sizes"),
        ("leaders.py", "points.txt", "Leaders"), ("peaks.py", "readings.txt", "Peak readings"))),
    "missing_return": (_missing_return, (
        ("weather.py", "mean_temperature", "temps.txt", "Average temperature"),
        ("ratings.py", "mean_rating", "ratings.txt", "Mean rating"),
        ("latency.py", "mean_latency", "latency_ms.txt", "Mean latency"),
        ("prices.py", "average_price", "prices.txt", "Average price"))),
    "wrong_path": (_wrong_path, (
        ("roster.py", "inputs", "input", "members.txt", "Members"),
        ("guests.py", "lists", "list", "guests.txt", "Guests"),
        ("todo.py", "notes", "data", "todo.txt", "Open tasks"), ("hosts.py", "config", "conf", "hosts.txt", "Hosts"))),
    "config_value": (_config_value, (
        ("invoice.py", "settings.json", "tax_percent", "sales tax", "+"),
        ("quote.py", "config.json", "markup_percent", "markup", "+"),
        ("checkout.py", "store.json", "discount_percent", "discount", "-"),
        ("freight.py", "options.json", "surcharge_percent", "fuel surcharge", "+"))),
    "unit_test": (_unit_test, (
        ("textutil", "word_count", "text", "The number of words in text, separated by any whitespace.",
         "len(text.split())", ("text.split()", 'text.split(" ")'), _texts, lambda text: len(text.split())),
        ("calendar_rules", "is_leap", "year", "True for the leap years of the Gregorian calendar.",
         "year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
         ("(year % 100 != 0 or year % 400 == 0)", "year % 100 != 0"), _years,
         lambda year: year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)),
        ("bounds", "clamp", "x, lo, hi", "x limited to the range lo..hi.", "max(lo, min(x, hi))",
         ("max(lo, min(x, hi))", "min(lo, max(x, hi))"), _clamps, lambda x, lo, hi: max(lo, min(x, hi))),
        ("names", "initials", "name", 'The first letter of each word of name, upper case: "ada lovelace" gives "AL".',
         '"".join(word[0].upper() for word in name.split())', ("word[0].upper()", "word[0]"), _names,
         lambda name: "".join(word[0].upper() for word in name.split())))),
    "shell_script": (_shell_script, (
        ("count_errors.sh", "app.log", "Prints how many lines mention error, in any case.", 'grep -ci error "$1"\n',
         ("grep -ci error", "grep -c ERROR"), _log, lambda n: f"{n}\n"),
        ("line_count.sh", "notes.txt", "Prints the number of lines of the file.", 'echo "Lines: $(wc -l < "$1")"\n',
         ('wc -l < "$1"', 'wc -l "$1"'), lambda rng: (_lines(ws := _words(rng, int(rng.integers(3, 9)))), len(ws)),
         lambda n: f"Lines: {n}\n"),
        ("sum.sh", "numbers.txt", "Prints the sum of the numbers in the file, one per line.",
         'total=0\nwhile read -r n; do\n  total=$((total + n))\ndone < "$1"\necho "Sum: $total"\n',
         ("$((total + n))", "$((n))"), _numbers, lambda v: f"Sum: {sum(v)}\n"),
        ("largest.sh", "sizes.txt", "Prints the largest number in the file.", 'sort -n "$1" | tail -n 1\n',
         ("sort -n", "sort"), lambda rng: (_lines(v := _top_numbers(rng)), max(v)), lambda m: f"{m}\n"))),
    "group_totals": (_group_totals, (
        ("by_category.py", "expenses.csv", "category", "amount"), ("by_region.py", "sales.csv", "region", "revenue"),
        ("by_project.py", "hours.csv", "project", "hours"), ("by_meal.py", "meals.csv", "meal", "calories"))),
    "swapped_args": (_swapped_args, (
        ("attendance.py", "roll.txt", "present", "absent", "Attendance"),
        ("progress.py", "tasks.txt", "done", "open", "Completed"), ("uptime.py", "checks.txt", "up", "down", "Uptime"),
        ("survey.py", "answers.txt", "yes", "no", "Yes"))),
}
