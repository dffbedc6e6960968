"""Fixtures for the tests of benchmarks/: its scripts imported as they run, with their folder first on sys.path."""

import importlib
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def import_benchmark():
  """A function that imports a script of benchmarks/ by name.

  The scripts import each other by name, so their folder goes first on
  sys.path, as it is when one of them runs.
  """

  def load(name: str):
    if str(BENCHMARKS) not in sys.path:
      sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)

  return load
