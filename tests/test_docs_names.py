"""Every backticked `ptx.` name in README.md and docs/*.md resolves to a module or to an attribute of one.

A name resolves when the longest importable prefix of it is a module and each
remaining part is an attribute of what comes before (a class, a function, a
dataclass field), or a name of the facade `ptx` (its lazy `__getattr__`
included). A trailing call, `ptx.config_rules.check(cfg, algorithm)`, is
dropped. Code spans count; fenced blocks do not (they show code, not names).
"""

import dataclasses
import importlib
import pathlib
import re
import typing

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^ *```.*?^ *```[^\n]*$", re.M | re.S)
SPAN = re.compile(r"`([^`]+)`")
NAME = re.compile(r"ptx(?:\.[A-Za-z_]\w*)+")


def names_in(text: str) -> list[tuple[int, str]]:
  """(line, dotted name) for each code span of `text` that starts with `ptx.`, call arguments dropped."""
  text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # blank the fenced blocks, keep line numbers
  found = []
  for span in SPAN.finditer(text):
    name = NAME.match(span.group(1).strip())
    if name:
      found.append((text.count("\n", 0, span.start()) + 1, name.group(0)))
  return found


def _module_prefix(parts: list[str]):
  """(the module of the longest importable prefix of `parts`, how many parts it takes)."""
  for n in range(len(parts), 0, -1):
    name = ".".join(parts[:n])
    try:
      return importlib.import_module(name), n
    except ModuleNotFoundError as e:
      if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
        raise  # the module exists but imports something missing: say so, do not try a shorter prefix
  raise ModuleNotFoundError(f"no module {parts[0]}")


def _attribute(obj, part: str):
  """`obj.part`, or the declared type of the dataclass field `part` of `obj`; raises AttributeError."""
  if hasattr(obj, part):
    return getattr(obj, part)
  fields = getattr(obj, "__dataclass_fields__", {})
  if part in fields:
    try:
      return typing.get_type_hints(obj).get(part, fields[part].type)
    except (NameError, TypeError):
      return fields[part].type
  raise AttributeError(f"{getattr(obj, '__name__', obj)!s} has no attribute or field {part!r}")


def unresolved(name: str) -> str | None:
  """Why the dotted `name` does not resolve, or None when it does."""
  parts = name.split(".")
  try:
    obj, n = _module_prefix(parts)
  except ImportError as e:
    return f"import failed: {e}"
  for i, part in enumerate(parts[n:], n):
    try:
      obj = _attribute(obj, part)
    except AttributeError:
      return f"{'.'.join(parts[:i])} has no attribute or field {part!r}"
  return None


def _failures(path: pathlib.Path, text: str | None = None) -> list[str]:
  """'file:line: `name` does not resolve (why)' for each name in the doc; `text` stands in for the file's."""
  text = path.read_text(encoding="utf-8") if text is None else text
  where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
  return [f"{where}:{line}: `{name}` does not resolve ({why})"
          for line, name in names_in(text) if (why := unresolved(name)) is not None]


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_every_ptx_name_in_the_docs_resolves(path):
  failures = _failures(path)
  assert not failures, "\n".join(failures)


def test_the_docs_name_ptx_modules():
  """The collector finds the docs' names at all (a broken pattern would pass the test above vacuously)."""
  counts = {p.name: len(names_in(p.read_text(encoding="utf-8"))) for p in DOCS}
  assert counts["README.md"] >= 5 and counts["DESIGN.md"] >= 20, counts


def test_a_planted_bad_name_is_reported_with_its_file_and_line():
  planted = ("# A doc\n\nGood: `ptx.config_rules.check(cfg, algorithm)`, `ptx.train_grpo`, `ptx.Config.grpo.rollouts`.\n"
             "```text\n`ptx.not_a_module.fenced`\n```\n"
             "Bad: `ptx.not_a_module.thing` and `ptx.config.no_such_name()`.\n")
  assert names_in(planted) == [(3, "ptx.config_rules.check"), (3, "ptx.train_grpo"), (3, "ptx.Config.grpo.rollouts"),
                               (7, "ptx.not_a_module.thing"), (7, "ptx.config.no_such_name")]
  failures = _failures(ROOT / "docs" / "planted.md", planted)
  assert len(failures) == 2, failures
  assert failures[0].startswith("docs/planted.md:7: `ptx.not_a_module.thing` does not resolve"), failures
  assert failures[1].startswith("docs/planted.md:7: `ptx.config.no_such_name` does not resolve"), failures
