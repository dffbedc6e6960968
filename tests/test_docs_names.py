"""Every backticked `ptx.` name in README.md and docs/*.md resolves to a module or to an attribute of one.

A name resolves when the longest importable prefix of it is a module and each
remaining part is an attribute of what comes before (a class, a function, a
dataclass field), or a name of the facade `ptx` (its lazy `__getattr__`
included). A trailing call, `ptx.config_rules.check(cfg, algorithm)`, is
dropped. Code spans count, and so does code in fenced blocks: each dotted
`ptx.` reference there and each name of a `from ptx... import a, b` line.
"""

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
CODE_NAME = re.compile(r"(?<![\w./-])ptx(?:\.[A-Za-z_]\w*)+")  # not part of a path or of a longer name
FROM_IMPORT = re.compile(r"^[ \t]*from (ptx(?:\.\w+)*) import ([\w, \t]+)$", re.M)


def names_in(text: str) -> list[tuple[int, str]]:
  """(line, dotted name), in order, for each `ptx.` name in the code spans and fenced blocks of `text`."""
  prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # fenced blocks blanked, lines kept
  found = []
  for span in SPAN.finditer(prose):
    name = NAME.match(span.group(1).strip())  # `ptx.x.y(...)`: the call is dropped
    if name:
      found.append((prose.count("\n", 0, span.start()) + 1, name.group(0)))
  for fence in FENCE.finditer(text):
    first = text.count("\n", 0, fence.start()) + 1
    code = fence.group(0)
    found += [(first + code.count("\n", 0, m.start()), m.group(0)) for m in CODE_NAME.finditer(code)]
    for m in FROM_IMPORT.finditer(code):
      found += [(first + code.count("\n", 0, m.start()), f"{m.group(1)}.{n.strip()}") for n in m.group(2).split(",")]
  return sorted(found)


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
  """Each `ptx.` name the document gives resolves; a failure names the file, the line and the name."""
  failures = _failures(path)
  assert not failures, "\n".join(failures)


def test_the_docs_name_ptx_modules():
  """The collector finds the docs' names at all (a broken pattern would pass the test above vacuously)."""
  counts = {p.name: len(names_in(p.read_text(encoding="utf-8"))) for p in DOCS}
  assert counts["README.md"] >= 5 and counts["DESIGN.md"] >= 20, counts


def test_a_planted_bad_name_is_reported_with_its_file_and_line():
  """Bad names in prose and in a fenced block fail, naming the file, line and name; the good ones pass."""
  planted = ("# A doc\n\n"
             "Good: `ptx.config_rules.check(cfg, algorithm)`, `ptx.train_grpo`, `ptx.Config.grpo.rollouts`.\n"
             "```text\nfrom ptx.sampling.engine.config import EngineConfig, no_such_config\n"
             "job = ptx.sft_job(cfg, tok)  # ~/.cache/ptx.d is a path\n```\n"
             "Bad: `ptx.not_a_module.thing` and `ptx.config.no_such_name()`.\n")
  assert names_in(planted) == [
      (3, "ptx.Config.grpo.rollouts"), (3, "ptx.config_rules.check"), (3, "ptx.train_grpo"),
      (5, "ptx.sampling.engine.config"), (5, "ptx.sampling.engine.config.EngineConfig"),
      (5, "ptx.sampling.engine.config.no_such_config"), (6, "ptx.sft_job"),
      (8, "ptx.config.no_such_name"), (8, "ptx.not_a_module.thing")]
  failures = _failures(ROOT / "docs" / "planted.md", planted)
  assert [f.split(" does not resolve")[0] for f in failures] == [
      "docs/planted.md:5: `ptx.sampling.engine.config.no_such_config`", "docs/planted.md:8: `ptx.config.no_such_name`",
      "docs/planted.md:8: `ptx.not_a_module.thing`"], failures
