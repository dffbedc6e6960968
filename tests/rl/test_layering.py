"""ptx.rl imports only ptx.data, ptx.config and itself; its child scripts import no ptx."""

import ast
import pathlib

import pytest

RL = pathlib.Path(__file__).resolve().parents[2] / "ptx" / "rl"
ALLOWED = ("ptx.rl", "ptx.data", "ptx.config")
# Run by path as separate processes (python -I), so they must not need ptx at all.
SCRIPTS = ("sandbox_child.py", "symbolic_worker.py")


def _ptx_imports(path: pathlib.Path) -> list[str]:
  names = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.append(node.module)
  return [n for n in names if n == "ptx" or n.startswith("ptx.")]


@pytest.mark.parametrize("path", sorted(RL.rglob("*.py")), ids=lambda p: str(p.relative_to(RL)))
def test_rl_imports_only_lower_layers(path):
  imports = _ptx_imports(path)
  if path.name in SCRIPTS:
    assert imports == [], f"{path.name} runs without ptx but imports {imports}"
  bad = [n for n in imports if not any(n == a or n.startswith(a + ".") for a in ALLOWED)]
  assert not bad, f"{path.relative_to(RL)} imports {bad}; ptx/rl may use only {ALLOWED}"
