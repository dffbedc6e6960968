"""A test that kills its xdist worker fails by name, and the run still ends (tests/crash_safe_scheduling.py).

With xdist's own loadfile scheduler (an empty conftest in `_nested_run`) every case here fails: the run
hangs, the crashed test kills its replacement worker too, or xdist stops with an internal error.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="the suite's runner (`make test` installs it)")

TESTS_DIR = Path(__file__).resolve().parent
# Files of three passing tests each, and one whose second test ends its worker process as an
# out-of-memory kill or an XLA abort would. Sleeps make the crash land while the other worker
# still has work, the case xdist 3.8 hangs in; none of them decides the outcome.
_PLAIN = "import time\ndef test_1(): time.sleep(0.3)\ndef test_2(): time.sleep(0.3)\ndef test_3(): pass\n"
_CRASHING = "import os, time\ndef test_1(): time.sleep(0.5)\ndef test_crash(): os._exit(1)\ndef test_after(): pass\n"


def _nested_run(tmp_path, files, *, safe, workers):
  """Runs pytest over `files` in `tmp_path` as `make test` does; returns (exit code, output), or None if it hung."""
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  hook = f"""
    import sys
    sys.path.insert(0, {str(TESTS_DIR)!r})
    from crash_safe_scheduling import CrashSafeLoadFileScheduling

    def pytest_xdist_make_scheduler(config, log):
      return CrashSafeLoadFileScheduling(config, log)
  """
  (tmp_path / "conftest.py").write_text(textwrap.dedent(hook) if safe else "")
  cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "-n", str(workers),
         "--dist", "loadfile", "--max-worker-restart=4", "-c", str(tmp_path / "pytest.ini"), str(tmp_path)]
  env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
  try:
    # 120 s: the nested run takes a few seconds even on a loaded machine; a hang never ends.
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  except subprocess.TimeoutExpired:
    return None
  return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("crashing_file", ["test_a.py", "test_c.py", "test_z.py"])
def test_a_crashed_worker_fails_its_test_by_name_and_the_run_ends(tmp_path, crashing_file, workers):
  files = {name: _PLAIN for name in ["test_a.py", "test_b.py", "test_c.py", "test_d.py", "test_z.py"]}
  files[crashing_file] = _CRASHING
  result = _nested_run(tmp_path, files, safe=True, workers=workers)
  assert result is not None, "the run hung after the worker crashed"
  code, out = result
  assert code == 1, out
  assert f"FAILED {crashing_file}::test_crash" in out, out
  assert f"crashed while running '{crashing_file}::test_crash'" in out, out
  # Every other test ran and passed once: the crashed one is not retried, nothing is lost.
  assert "1 failed, 14 passed" in out, out

