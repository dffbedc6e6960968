"""Every Python and shell source line fits CONTRIBUTING's 120 columns, so diffs and reviews read without wrapping."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("ptx", "kernels", "recipes", "tests", "benchmarks", ".ci")
LIMIT = 120


def _sources():
  for directory in SOURCE_DIRS:
    for path in sorted((ROOT / directory).rglob("*")):
      if path.is_file() and (path.suffix in (".py", ".sh") or path.parent.name == ".ci"):
        yield path


def test_no_source_line_is_longer_than_the_limit():
  sources = list(_sources())
  assert len(sources) > 100, f"found only {len(sources)} source files under {SOURCE_DIRS}: the walk is broken"
  long = [f"{path.relative_to(ROOT)}:{number}: {len(line)} columns"
          for path in sources for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
          if len(line) > LIMIT]
  assert not long, f"lines over {LIMIT} columns (docs/CONTRIBUTING.md, item 20):\n" + "\n".join(long)
