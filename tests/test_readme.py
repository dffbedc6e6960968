"""The README's library example runs as written."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_library_example_runs():
  readme = (ROOT / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
  assert blocks, "README.md has no python example"
  namespace: dict = {}
  exec(compile(blocks[0], "README.md", "exec"), namespace)
  assert namespace["logits"].shape == (8, 16, 259)
  assert int(namespace["state"].step) == 3


def test_readme_gives_the_two_commands():
  readme = (ROOT / "README.md").read_text()
  assert "make demo" in readme and "make test" in readme
