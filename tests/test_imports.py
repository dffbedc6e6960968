"""Imports flow one way, room by room, and every program run by path imports only the standard library.

The layers, top to bottom: entry points (cli, env_flags, eval_command, demo, scoring_flags) -> train
-> train.grpo -> the training core (state, step, optimizer) -> episodes ->
envs -> algorithms -> sampling -> models -> data -> sharding -> config; at the
bottom the three rooms that import nothing else from ptx (sandbox,
scheduling, verifiers) and `ptx_kernels`. A module may import its own layer
and lower ones. On top of the order:

- sandbox, scheduling and verifiers import only from their own package;
- every module under an `inside/` folder is a program loaded by path into
  another process (a sandbox, a worker): it imports the standard library,
  its siblings in that folder and nothing else (`OUTSIDE_STDLIB` names the
  two exceptions);
- envs never import sampling, models or train; episodes reach the sandbox
  only through envs; train reaches the sandbox and scheduling only through
  episodes;
- no GRPO step kind (fused, host, engine, episodes) imports a sibling: what
  they share lives below them (`train.grpo.update`, `data.lookahead`,
  `sampling.engine.config`, `episodes.scoring`);
- only `ptx.cli` imports the facade `ptx` (ptx/__init__.py), which would
  tie every layer to every other;
- the import graph has no cycle, lazy and `TYPE_CHECKING` imports included.
"""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Higher layers may import lower ones and their own layer; never upwards. The longest matching prefix decides.
LAYERS = {
    "ptx.cli": 12, "ptx.demo": 12, "ptx.scoring_flags": 12, "ptx.lm_eval_model": 12, "ptx.env_flags": 12,
    "ptx.eval_command": 12,
    "ptx.train": 11,
    "ptx.train.grpo": 10,
    "ptx.train.state": 9, "ptx.train.step": 9, "ptx.train.optimizer": 9,
    "ptx.episodes": 8,
    "ptx.envs": 7,
    "ptx.algorithms": 6,
    "ptx.sampling": 5,
    "ptx.models": 4,
    "ptx.data": 3,
    "ptx.sharding": 2,
    "ptx.config_io": 1, "ptx.config_rules": 1, "ptx.config": 1, "ptx.model_config": 1, "ptx.compile_cache": 1,
    "ptx.paths": 1,
    "ptx.sandbox": 0, "ptx.scheduling": 0, "ptx.verifiers": 0, "ptx_kernels": 0,
}
# Rooms that import nothing from ptx outside themselves.
SELF_CONTAINED = ("ptx.sandbox", "ptx.scheduling", "ptx.verifiers", "ptx_kernels")
# module prefix -> prefixes it may not import, beyond what the order forbids.
FORBIDDEN = {
    "ptx.envs": ("ptx.sampling", "ptx.models", "ptx.train"),
    "ptx.episodes": ("ptx.sandbox",),
    "ptx.train": ("ptx.sandbox", "ptx.scheduling"),
}
# Programs run by path that import one thing beyond the standard library and their siblings, and why.
OUTSIDE_STDLIB = {
    "ptx.verifiers.inside.sympy_worker": "sympy",  # the worker process exists to run sympy, outside any sandbox
    "ptx.verifiers.inside.solution_server": "solution",  # the model's code, written beside it in its sandbox
}
STEP_KINDS = ("ptx.train.grpo.fused", "ptx.train.grpo.host", "ptx.train.grpo.engine", "ptx.train.grpo.episodes")


def _matches(module: str, prefix: str) -> bool:
  return module == prefix or module.startswith(prefix + ".")


def _layer(module: str) -> int:
  for prefix in sorted(LAYERS, key=len, reverse=True):
    if _matches(module, prefix):
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


def _imports(source: str):
  """(imported module, line) for every import in the source, wherever it sits (functions, TYPE_CHECKING blocks)."""
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, node.lineno
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module == "ptx" or node.module in PACKAGES:  # `from ptx.x import y` may name the submodule ptx.x.y
        for alias in node.names:
          child = f"{node.module}.{alias.name}"
          yield (child if child in MODULE_NAMES or node.module == "ptx" else node.module), node.lineno
      else:
        yield node.module, node.lineno


MODULES = list(_modules())
MODULE_NAMES = {m for m, _ in MODULES}
PACKAGES = {m for m, p in MODULES if p.name == "__init__.py"}


def _ptx_imports(path: pathlib.Path):
  return [(n, line) for n, line in _imports(path.read_text()) if _matches(n, "ptx") or _matches(n, "ptx_kernels")]


def _violations(module: str, path: pathlib.Path, source: str | None = None) -> list[str]:
  """Every rule of the module docstring that one module's imports break, as 'file:line: why'.

  `source` stands in for the file's text (a planted import).
  """
  if module == "ptx":
    return []  # the facade re-exports every layer
  found = []
  for name, line in _imports(path.read_text() if source is None else source):
    where = f"{path.relative_to(ROOT)}:{line}"
    if "inside" in path.relative_to(ROOT).parts[:-1]:
      top = name.split(".")[0]
      siblings = {p.stem for p in path.parent.glob("*.py")}
      if top not in sys.stdlib_module_names and top not in siblings and top != OUTSIDE_STDLIB.get(module):
        found.append(f"{where}: {module} runs by path with the standard library only, but imports {name}")
      continue
    if name == "ptx":
      if module != "ptx.cli":
        found.append(f"{where}: {module} imports the ptx facade; import the submodule instead")
      continue
    if not (_matches(name, "ptx") or _matches(name, "ptx_kernels")):
      continue
    own = next((room for room in SELF_CONTAINED if _matches(module, room)), None)
    if own is not None and not _matches(name, own):
      found.append(f"{where}: {module} belongs to {own}, which imports nothing else from ptx, but imports {name}")
      continue
    if _layer(name) > _layer(module):
      found.append(f"{where}: {module} (layer {_layer(module)}) imports {name} (layer {_layer(name)})")
    for prefix, banned in FORBIDDEN.items():
      if _matches(module, prefix) and any(_matches(name, b) for b in banned):
        found.append(f"{where}: {module} may not import {name} ({prefix} never imports {', '.join(banned)})")
    kind = next((k for k in STEP_KINDS if _matches(module, k)), None)
    if kind is not None and any(_matches(name, k) for k in STEP_KINDS if k != kind):
      found.append(f"{where}: the GRPO step kind {kind} imports its sibling {name}; move the shared piece down")
  return found


@pytest.mark.parametrize("module, path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_follow_the_rooms(module, path):
  assert not _violations(module, path), "\n".join(_violations(module, path))


def test_no_import_cycle():
  """Module -> the ptx modules it imports (each import resolved to the deepest known module) has no cycle."""
  _check_acyclic({m: sorted({n for n, _ in _ptx_imports(p) if n in MODULE_NAMES and n != m}) for m, p in MODULES})


def _check_acyclic(graph: dict[str, list[str]]) -> None:
  """Raises AssertionError naming a cycle of `graph` (depth-first search), if it has one."""
  state: dict[str, int] = {}  # 1 on the current path, 2 done

  def visit(module: str, path: list[str]) -> None:
    state[module] = 1
    for child in graph[module]:
      if state.get(child) == 1:
        cycle = path[path.index(child):] + [child] if child in path else [module, child]
        raise AssertionError("import cycle: " + " -> ".join(cycle))
      if child not in state and child in graph:
        visit(child, path + [child])
    state[module] = 2

  for module in graph:
    if module not in state:
      visit(module, [module])


def test_the_rules_catch_an_upward_import_a_sibling_step_kind_and_a_program_importing_ptx():
  """Planted violations: each rule above fails on the import it forbids (so none of them passes vacuously)."""
  planted = {
      "ptx.envs.planted": "from ptx.sampling import generation\n",
      "ptx.sandbox.planted": "from ptx.scheduling import scheduler\n",
      "ptx.episodes.planted": "from ptx.sandbox import run\n",
      "ptx.train.planted": "from ptx.scheduling import executors\n",
      "ptx.train.grpo.engine": "from ptx.train.grpo import host\n",
      "ptx.verifiers.inside.planted": "import numpy\n",
      "ptx.sandbox.inside.init": "from ptx.sandbox import result\n",
      "ptx.models.planted": "from ptx.train import job\n",
      "ptx.data.planted": "import ptx\n",
  }
  for module, source in planted.items():
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")  # not read: `source` stands in
    assert _violations(module, path, source), f"{module}: `{source.strip()}` broke no rule"


def test_an_import_cycle_is_found():
  graph_cycle = {"a": ["b"], "b": ["c"], "c": ["a"]}
  with pytest.raises(AssertionError, match="a -> b -> c -> a"):
    _check_acyclic(graph_cycle)
