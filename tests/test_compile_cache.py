"""ptx.compile_cache: where the persistent compilation cache goes, and that a second process reuses it."""

import json
import os
import subprocess
import sys

import pytest

# Enables the cache, compiles one program, and reports the directory and JAX's cache hits and misses.
_SCRIPT = """
import json, jax, jax.numpy as jnp
from ptx import compile_cache
counts = {"hits": 0, "misses": 0}
def count(event, **kwargs):
  if event == "/jax/compilation_cache/cache_hits": counts["hits"] += 1
  if event == "/jax/compilation_cache/cache_misses": counts["misses"] += 1
jax.monitoring.register_event_listener(count)
directory = compile_cache.enable()
jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((8, 8))).block_until_ready()
print(json.dumps({"directory": directory, **counts}))
"""


def _run(tmp_path, **env) -> dict:
  """Runs _SCRIPT in a fresh process with `env` (None removes a variable) and returns its report."""
  full = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "XDG_CACHE_HOME": str(tmp_path / "xdg")}
  full.pop("JAX_COMPILATION_CACHE_DIR", None)  # the test run's own cache (conftest)
  for name, value in env.items():
    if value is None:
      full.pop(name, None)
    else:
      full[name] = value
  # A hang guard only: importing JAX and compiling one tiny program takes seconds, even on a loaded machine.
  out = subprocess.run([sys.executable, "-c", _SCRIPT], env=full, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_nothing_the_first_one_cached(tmp_path):
  cache = tmp_path / "cache"
  first = _run(tmp_path, PTX_COMPILATION_CACHE=str(cache))
  assert first["directory"] == str(cache)
  assert first["hits"] == 0 and first["misses"] >= 1
  assert len(list(cache.iterdir())) == first["misses"]
  second = _run(tmp_path, PTX_COMPILATION_CACHE=str(cache))
  assert (second["hits"], second["misses"]) == (first["misses"], 0)


def test_the_default_directory_is_under_the_users_cache_home(tmp_path):
  report = _run(tmp_path, PTX_COMPILATION_CACHE=None)
  assert report["directory"] == str(tmp_path / "xdg" / "ptx" / "jax")
  assert any((tmp_path / "xdg" / "ptx" / "jax").iterdir())


@pytest.mark.parametrize("value", ["off", "0", "OFF"])
def test_off_turns_the_cache_off(tmp_path, value):
  report = _run(tmp_path, PTX_COMPILATION_CACHE=value)
  assert (report["directory"], report["hits"], report["misses"]) == (None, 0, 0)
  assert not (tmp_path / "xdg").exists()


def test_a_directory_already_given_to_jax_is_kept(tmp_path):
  theirs = tmp_path / "theirs"
  report = _run(tmp_path, PTX_COMPILATION_CACHE=None, JAX_COMPILATION_CACHE_DIR=str(theirs))
  assert report["directory"] == str(theirs)
  assert any(theirs.iterdir()) and not (tmp_path / "xdg").exists()
