"""The distribution lists every package, and ptx_kernels imports from anywhere."""

import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
  listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
  found = set()
  for top, name in (("ptx", "ptx"), ("kernels", "ptx_kernels")):
    for init in (ROOT / top).rglob("__init__.py"):
      rel = init.parent.relative_to(ROOT / top).parts
      found.add(".".join((name,) + rel))
  assert found == listed, f"pyproject [tool.setuptools].packages is out of date: {found ^ listed}"


def test_ptx_kernels_imports_from_another_directory(tmp_path):
  out = subprocess.run(
      [sys.executable, "-c", "import ptx_kernels, ptx; print(ptx_kernels.__file__)"],
      cwd=tmp_path, capture_output=True, text=True, check=True)
  assert "kernels" in out.stdout


def test_test_file_names_are_unique():
  # pytest imports test modules by basename (no __init__.py), so two files with one name collide.
  names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
  assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
