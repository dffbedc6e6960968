"""ptx.rl never imports upwards (ptx.train, ptx.cli) nor the facade; its child scripts import no ptx.

tests/test_imports.py checks the whole layer order; this adds what is particular
to ptx.rl: the scripts it runs by path as separate processes (`python -I`)
must work without ptx on the path at all.
"""

import ast
import pathlib

import pytest

RL = pathlib.Path(__file__).resolve().parents[2] / "ptx" / "rl"
FORBIDDEN = ("ptx.train", "ptx.cli")
SCRIPTS = ("grader.py", "plain_data.py", "sandbox_child.py", "sandbox_init.py", "solution_server.py",
           "symbolic_worker.py", "workspace_format.py")


def _ptx_imports(path: pathlib.Path) -> list[str]:
  names = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names += [f"ptx.{a.name}" for a in node.names] if node.module == "ptx" else [node.module]
  return [n for n in names if n == "ptx" or n.startswith("ptx.")]


@pytest.mark.parametrize("path", sorted(RL.rglob("*.py")), ids=lambda p: str(p.relative_to(RL)))
def test_rl_imports_only_lower_layers(path):
  imports = _ptx_imports(path)
  if path.name in SCRIPTS:
    assert imports == [], f"{path.name} runs without ptx but imports {imports}"
  bad = [n for n in imports if n == "ptx" or any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
  assert not bad, f"{path.relative_to(RL)} imports {bad}; ptx/rl may not import {FORBIDDEN} or the facade"
