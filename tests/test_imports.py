"""Imports flow one way: entry points -> train -> rl -> algorithms -> sampling -> models -> data -> sharding -> config.

`ptx.compile_cache` imports only jax and sits at the bottom with config, as does
`ptx.paths` (etils.epath only).

`ptx_kernels` imports nothing from ptx, and no internal module imports the
`ptx` facade (ptx/__init__.py), which would tie every layer to every other.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Higher layers may import lower ones and their own layer; never upwards.
LAYERS = {
    "ptx.cli": 9, "ptx.demo": 9,
    "ptx.train": 8,
    "ptx.rl": 7,
    "ptx.algorithms": 6,
    "ptx.sampling": 5,
    "ptx.models": 4,
    "ptx.data": 3,
    "ptx.sharding": 2,
    "ptx.config_io": 1, "ptx.config_rules": 1, "ptx.config": 1, "ptx.compile_cache": 1, "ptx.paths": 1,
    "ptx_kernels": 0,
}


def _layer(module: str) -> int:
  for prefix in sorted(LAYERS, key=len, reverse=True):
    if module == prefix or module.startswith(prefix + "."):
      return LAYERS[prefix]
  raise AssertionError(f"module {module} has no layer in tests/test_imports.py")


def _modules():
  for path in sorted((ROOT / "ptx").rglob("*.py")):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    yield ".".join(parts), path
  for path in sorted((ROOT / "kernels").rglob("*.py")):
    rel = path.relative_to(ROOT / "kernels").with_suffix("")
    yield ".".join(["ptx_kernels"] + [p for p in rel.parts if p != "__init__"]), path


def _imports(path: pathlib.Path):
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, node.lineno
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module == "ptx":  # `from ptx import x` names the submodule ptx.x
        for alias in node.names:
          yield f"ptx.{alias.name}", node.lineno
      else:
        yield node.module, node.lineno


MODULES = list(_modules())


@pytest.mark.parametrize("module, path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_flow_downward(module, path):
  if module == "ptx":
    return  # the facade re-exports every layer
  for name, line in _imports(path):
    if name == "ptx" and module not in ("ptx.cli",):
      raise AssertionError(f"{path}:{line} imports the ptx facade; import the submodule instead")
    if not (name.startswith("ptx.") or name.startswith("ptx_kernels")):
      continue
    if module.startswith("ptx_kernels"):
      assert name.startswith("ptx_kernels"), f"{path}:{line}: ptx_kernels imports {name} from ptx"
      continue
    assert _layer(name) <= _layer(module), (
        f"{path}:{line}: {module} (layer {_layer(module)}) imports {name} (layer {_layer(name)})")
