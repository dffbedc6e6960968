"""The sandbox's attack suites again as an unprivileged user (uid 65534): CI runs as root, users mostly do not.

Without root the sandbox gets no uid of its own per run, so the same attacks
meet a different confinement: this runs them in a subprocess as nobody and
requires every test to pass and none to skip, so no attack silently drops out.
The suites of the code and shell environments join when their files exist.
"""

import os
import pathlib
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from ptx.sandbox.inside import workspace

REPO = pathlib.Path(__file__).resolve().parents[2]
NOBODY = 65534
_SUITES = ("tests/sandbox/test_sandbox.py", "tests/sandbox/test_workspace.py")
_IF_PRESENT = ("tests/envs/test_python_tests_hacks.py", "tests/envs/test_shell_hacks.py")
# The suites take about 20 s here as nobody and a few times that on a loaded machine; the limit stays
# under the 600 s pytest-timeout of this test itself, so a hang fails here with the subprocess's output.
_TIMEOUT_S = 540
_NOT_READABLE = 97  # the probe's exit status: nobody cannot read the repository or the venv


def _traversable_by_others(path: pathlib.Path) -> bool:
  return bool(path.stat().st_mode & stat.S_IXOTH)


def _blocked(needed: list[pathlib.Path]) -> dict[pathlib.Path, list[pathlib.Path]]:
  """For each directory above a needed path that others may not pass (/root, for a pyenv Python): what lies below it."""
  blockers = {}
  for path in needed:
    for parent in reversed(path.parents):
      if not _traversable_by_others(parent):
        blockers.setdefault(parent, []).append(path)
        break
  return blockers


def _script(blockers: dict[pathlib.Path, list[pathlib.Path]], stage: pathlib.Path, probe: list[str],
            pytest_argv: list[str]) -> str:
  """The shell script that makes the needed paths reachable (when something blocks them) and runs the suites as nobody.

  In a private mount namespace, each blocking directory is covered by an empty
  tmpfs that anyone may pass, and the paths needed below it are bound back at
  their own places: nothing else of it becomes visible, and nothing changes
  outside this subprocess. The probe runs only when the suites fail, to tell
  an unreadable repository or venv from a failed attack (it starts JAX again:
  seconds the passing run need not spend).
  """
  lines = ["set -e"]
  for i, (blocker, paths) in enumerate(blockers.items()):
    for j, path in enumerate(paths):
      lines += [f"mkdir -p {stage}/{i}-{j}", f"mount --bind {shlex.quote(str(path))} {stage}/{i}-{j}"]
    lines.append(f"mount -t tmpfs -o mode=0755,size=1m ptx-unprivileged {shlex.quote(str(blocker))}")
    for j, path in enumerate(paths):
      lines += [f"mkdir -p {shlex.quote(str(path))}", f"mount --move {stage}/{i}-{j} {shlex.quote(str(path))}"]
  as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all", "--"]
  lines.append(f"rc=0; {shlex.join(as_nobody + pytest_argv)} || rc=$?")
  lines.append(f"[ $rc -eq 0 ] || {shlex.join(as_nobody + probe)} || exit {_NOT_READABLE}")
  lines.append("exit $rc")
  return "\n".join(lines)


def test_the_attack_suites_pass_as_an_unprivileged_user():
  if os.geteuid() != 0:
    pytest.skip("already unprivileged: the suite itself ran as non-root")
  missing = [tool for tool in ("setpriv", "unshare", "mount") if not shutil.which(tool)]
  assert not missing, f"running the suites as nobody needs util-linux's {missing}"
  suites = list(_SUITES) + [s for s in _IF_PRESENT if (REPO / s).exists()]
  # HOME and TMPDIR: a fresh directory only nobody may write (pytest's tmp_path lands there too).
  home = pathlib.Path(tempfile.mkdtemp(prefix="ptx-unprivileged-"))
  try:
    home.chmod(0o700)
    os.chown(home, NOBODY, NOBODY)
    stage = home / "stage"  # bind mounts wait here while a blocking directory is covered
    venv = pathlib.Path(sys.prefix)
    base = pathlib.Path(os.path.realpath(sys.base_prefix))  # a venv's interpreter and standard library
    blockers = _blocked([REPO, venv, base])
    reads = "import sys, jax, pytest, ptx.sandbox.run\nfor f in sys.argv[1:]: open(f).close()"
    probe = [sys.executable, "-c", reads, *suites, "tests/conftest.py"]
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *suites]
    script = _script(blockers, stage, probe, pytest_argv)
    command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script] if blockers else [
        "sh", "-c", script]
    # A clean environment: nothing of this run's (its compilation cache, xdist's variables, PTX_SANDBOX);
    # tests/conftest.py sets up the CPU devices and, told to, no compilation cache of its own.
    env = {"PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(home),
           "LANG": "C.UTF-8", "JAX_PLATFORMS": "cpu", "PTX_TEST_COMPILE_CACHE": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.monotonic()
    proc = subprocess.run(command, check=False, cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=_TIMEOUT_S)
    took = time.monotonic() - started
  finally:
    workspace.remove(str(home))  # whatever the suites left: deep, locked trees included
  output = proc.stdout + proc.stderr
  assert proc.returncode != _NOT_READABLE, (
      f"uid {NOBODY} cannot read the repository ({REPO}) or the venv ({venv}, its Python under {base}); make them "
      f"world-readable to run the attack suites unprivileged:\n{output[-4000:]}")
  assert proc.returncode == 0, f"the attack suites failed as uid {NOBODY} ({took:.0f} s):\n{output[-12000:]}"
  skipped = re.findall(r"^SKIPPED \[.*$|\d+ skipped", output, re.MULTILINE)
  assert not skipped, f"attacks skipped as uid {NOBODY}: {skipped}"
  assert re.search(r"\d+ passed", output), output[-2000:]
