"""Adversarial tests of ptx.sandbox.run's default (bwrap) backend: each attack is contained, the host unharmed.

Every attack program carries a random marker in its command line (`_py`), and
`_assert_contained` checks after the run that a result came back, that it is
not an infra error (nothing a started program does may produce one: those are
retried and left out of group baselines), and that no process anywhere still
has the marker: whatever the program forked, daemonized or left behind is
gone. Where the weaker rlimits backend does not contain an attack and trying
it there is harmless, the test runs it there too and asserts that it works,
which shows the check can fail. tests/sandbox/test_sandbox_unprivileged.py runs this
file again as an unprivileged user, so nothing here skips for want of root.
"""

import ast
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import errno
import os
import pathlib
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from ptx.sandbox import bwrap, run as sandbox, capture, strays
from ptx.sandbox.inside import workspace as workspace_format

# The wall clock is generous so a loaded machine cannot turn a limit into a
# timeout; the attacks that only a timeout stops set a short one themselves.
LIMITS = sandbox.Limits(timeout_s=20.0, cpu_s=1, memory_bytes=256 << 20, file_bytes=1 << 20,
                        processes=16, open_files=32, output_bytes=1 << 16)
SHORT = dataclasses.replace(LIMITS, timeout_s=1.5)
ROOT = os.geteuid() == 0
REPO = pathlib.Path(__file__).resolve().parents[2]
# A program whose host process dies is gone when the kernel has torn its PID
# namespace down, at once in principle; 20 s covers a machine whose 2 cores
# are busy with other tests.
GONE_WITHIN_S = 20.0
_IPC_CREAT, _IPC_RMID = 0o1000, 0
_CLONE_NEWUSER = 0x10000000
_libc = ctypes.CDLL(None, use_errno=True)
# glibc keeps mq_open in librt before 2.34 and in libc itself since.
_rt = _libc if hasattr(_libc, "mq_open") else ctypes.CDLL("librt.so.1", use_errno=True)


def _marker() -> str:
  return f"ptx-attack-{secrets.token_hex(8)}"


def _marked(marker: str) -> dict[int, list[bytes]]:
  """The live processes, anywhere on the host, whose command line holds `marker`: pid -> argv.

  bwrap and the sandbox's PID 1 carry the program's argv in their own, encoded
  (hex), so they count too. A process whose memory is gone (an empty command
  line: a zombie, or one the kernel is tearing down) runs none of its code.
  """
  needles = (marker.encode(), marker.encode().hex().encode())
  found = {}
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/cmdline", "rb") as f:
          cmdline = f.read()
      except OSError:
        continue  # it exited while we looked
      if any(n in cmdline for n in needles):
        found[int(name)] = cmdline.split(b"\0")
  return found


def _survivors(marker: str, within_s: float) -> dict[int, list[bytes]]:
  """The marked processes still alive after up to `within_s`: {} once two reads 0.1 s apart find none.

  One empty read proves nothing: a process in the middle of an exec (the
  stand-in becoming bwrap, setpriv becoming the stand-in) has no command line
  for an instant, so a run of them reads as gone just before the next one
  appears (3 failures in 44 runs of the test below, 12-06; none in 40 since).
  """
  deadline, none_before = time.monotonic() + within_s, False
  while True:
    found = _marked(marker)
    if not found and none_before:
      return {}
    none_before = not found
    if found and time.monotonic() > deadline:
      return found
    time.sleep(0.1)


def _live_of_uid(uid: int) -> list[int]:
  """The processes of `uid` that still run code (see `_marked`)."""
  pids = []
  for pid in strays.live_pids(uid):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if f.read():
          pids.append(pid)
    except OSError:
      pass  # it exited while we looked
  return pids


def _assert_contained(result: sandbox.SandboxResult, marker: str) -> None:
  """A result came back, the program's doings are not an infra error, and none of its processes is left."""
  assert isinstance(result, sandbox.SandboxResult)
  assert result.backend == sandbox.Backend.BWRAP
  assert result.outcome != sandbox.Outcome.INFRA_ERROR, result.reason
  assert _marked(marker) == {}, f"processes of the run survived it: {result}"
  if ROOT:
    assert result.uid is not None and _live_of_uid(result.uid) == [], "a process of the run's uid survived it"
  os.kill(os.getpid(), 0)  # this process is alive


def _py(code: str, *, limits: sandbox.Limits = LIMITS, **kwargs) -> sandbox.SandboxResult:
  """Runs `python3 -c code`, marked, under the default backend; asserts containment and returns the result."""
  marker = _marker()
  result = sandbox.run(["python3", "-c", f"{code}\n# {marker}"], limits=limits, **kwargs)
  _assert_contained(result, marker)
  return result


@contextlib.contextmanager
def _weaker():
  """Runs in the block use the rlimits backend, to show an attack the default contains works there."""
  before = sandbox.backend()
  sandbox.use("rlimits")
  try:
    yield
  finally:
    sandbox.use(before)


def _weak_py(code: str, **kwargs) -> sandbox.SandboxResult:
  with _weaker():
    result = sandbox.run(["python3", "-c", code], limits=kwargs.pop("limits", LIMITS), **kwargs)
  assert result.backend == sandbox.Backend.RLIMITS and result.outcome == sandbox.Outcome.OK, result
  return result


def _lines(result: sandbox.SandboxResult) -> dict[str, str]:
  """The program's `name value` output lines as a dict."""
  return dict(line.split(" ", 1) for line in result.stdout_text.splitlines() if " " in line)


@pytest.fixture(scope="module", autouse=True)
def _default_backend_works():
  assert sandbox.backend() == sandbox.Backend.BWRAP, "the default backend must be bwrap here"
  result = sandbox.run(["python3", "-c", "print(1)"], limits=LIMITS)
  assert result.outcome == sandbox.Outcome.OK, f"python3 does not run in the sandbox: {result.reason}"


def test_ok_run_reports_output_usage_and_isolation():
  result = _py("import os, sys; print(sorted(os.environ)); sys.stderr.write('e')")
  assert result.outcome == sandbox.Outcome.OK and result.exit_code == 0
  assert result.stderr == b"e"
  assert result.usage.wall_s > 0 and result.usage.max_rss_bytes > 0
  assert result.network_isolated and result.notes == ()
  assert (result.uid is not None) == ROOT


def test_nonzero_exit_is_failed_and_segfault_is_crashed():
  assert _py("import sys; sys.exit(3)").outcome == sandbox.Outcome.FAILED
  crashed = _py("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
  assert crashed.outcome == sandbox.Outcome.CRASHED and crashed.exit_code == -signal.SIGSEGV


def test_files_stdin_and_extra_env_reach_the_program():
  main = "import os, sys\nd = sys.stdin.read()\nprint(len(d), d[-2:], os.environ['MODE'], os.getcwd())"
  result = sandbox.run(["python3", "main.py"], files={"main.py": main}, stdin="x" * 200_000 + "ab",
                       env={"MODE": "m"}, limits=LIMITS)
  assert result.outcome == sandbox.Outcome.OK, result.stderr_text
  assert result.stdout_text == "200002 ab m /work\n"


def test_missing_program_is_an_infra_error():
  result = sandbox.run(["no-such-program-ptx"], limits=LIMITS)
  assert result.outcome == sandbox.Outcome.INFRA_ERROR and "no-such-program-ptx" in result.reason


def test_bad_limits_and_argv_name_the_field():
  with pytest.raises(ValueError, match="Limits.timeout_s"):
    sandbox.Limits(timeout_s=0)
  with pytest.raises(ValueError, match="argv"):
    sandbox.run([])
  with pytest.raises(ValueError, match="inside the workspace"):
    sandbox.run(["true"], files={"../escape": "x"})


def test_run_closes_pass_fds_once():
  """Descriptors this process opens while a run with pass_fds is in progress stay open after it returns."""
  ready_r, ready_w = os.pipe()
  go_r, go_w = os.pipe()
  spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(4)]  # more numbers than the run reuses for itself
  code = f"import os\nos.write({ready_w}, b'+')\nos.read({go_r}, 1)"
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    future = pool.submit(sandbox.run, ["python3", "-c", code], limits=LIMITS, pass_fds=(ready_w, go_r, *spare))
    try:
      assert os.read(ready_r, 1) == b"+"
      # The program has started, so run() has closed what it was passed: these take those numbers.
      mine = [os.open(os.devnull, os.O_RDONLY) for _ in range(16)]
    finally:
      os.write(go_w, b"+")
    assert future.result().outcome == sandbox.Outcome.OK
  closed = []
  for fd in mine:
    try:
      os.fstat(fd)
      os.close(fd)
    except OSError:
      closed.append(fd)
  os.close(ready_r)
  os.close(go_w)
  assert closed == [], f"run() closed descriptors it did not own: {closed}"


def test_attack_a_string_argv_is_refused():
  """A str would otherwise be a sequence of one-character arguments: exec "p" with "y", "t"... as its arguments."""
  for argv in ("python3 -c 1", b"python3 -c 1", ["python3", b"-c", "1"]):
    with pytest.raises(ValueError, match="argv"):
      sandbox.run(argv, limits=LIMITS)


def test_attack_an_argv_no_program_could_receive_is_refused():
  """A NUL byte, a string the file system encoding cannot hold, or more than fits a command line: the caller's
  error (ValueError), never a run that ends as an infrastructure error."""
  for argv in (["sh", "-c", "echo a\0b"], ["echo", "\ud800"], ["sh", "-c", ":" * (sandbox.MAX_ARGV_BYTES + 1)]):
    with pytest.raises(ValueError, match="argv"):
      sandbox.run(argv, limits=LIMITS)
  longest = ["sh", "-c", ": " + "x" * (sandbox.MAX_ARGV_BYTES - 64)]
  assert sandbox.run(longest, limits=LIMITS).outcome == sandbox.Outcome.OK


# Processes and signals.


def test_attack_fork_bomb():
  """Forks until RLIMIT_NPROC refuses, in every child, forever."""
  result = _py("import os\nwhile True:\n  try: os.fork()\n  except OSError: pass", limits=SHORT)
  assert result.outcome in (sandbox.Outcome.TIMEOUT, sandbox.Outcome.LIMIT), result.reason


def test_attack_infinite_busy_loop_hits_the_cpu_limit():
  result = _py("while True: pass")
  assert result.outcome == sandbox.Outcome.LIMIT and "CPU" in result.reason


def test_attack_infinite_sleeping_loop_hits_the_wall_clock():
  result = _py("import time\nwhile True: time.sleep(1)", limits=SHORT)
  assert result.outcome == sandbox.Outcome.TIMEOUT


def test_a_memory_cap_past_the_host_is_not_sampled_and_the_wall_clock_still_holds():
  # PID 1 then waits on the program alone (no 20 ms sampling for a long-lived run): exits and the
  # deadline must still end it.
  whole_host = dataclasses.replace(SHORT, memory_bytes=sandbox.host_memory_bytes())
  assert _py("print('done')", limits=whole_host).stdout_text == "done\n"
  result = _py("import time\nwhile True: time.sleep(1)", limits=whole_host)
  assert result.outcome == sandbox.Outcome.TIMEOUT, result


# Each program returns with a known result unless the sandbox loses it: the sandbox must return
# each time with that result, never raise and never blame itself. target -> (code, outcomes, exit code).
_KILL_LOOPS = {
    # Every process kills every other it can reach: the run's own, never PID 1 or the host's. 0.3 s lets
    # the five race each other many times over and keeps ten runs short.
    "kill(-1)": (("import os, signal, time\nfor _ in range(4):\n  if os.fork() == 0: break\n"
                  "end = time.monotonic() + 0.3\nwhile time.monotonic() < end:\n"
                  "  try: os.kill(-1, signal.SIGKILL)\n  except OSError: pass"),
                 (sandbox.Outcome.OK, sandbox.Outcome.CRASHED), None),
    # Every signal to PID 1 (its parent): the kernel drops those PID 1 of a namespace has no handler for.
    "pid 1": (("import os\nfor _ in range(50):\n  for sig in range(1, 65):\n    for pid in (1, os.getppid()):\n"
               "      try: os.kill(pid, sig)\n      except OSError: pass\nraise SystemExit(7)"),
              (sandbox.Outcome.FAILED,), 7),
    # Its own process group, PID 1's group (-1: everything) and its session, from several processes.
    "process group": (("import os, signal\nfor _ in range(3): os.fork()\nwhile True:\n"
                       "  for pgid in (os.getpgid(1), os.getpgrp(), 0):\n"
                       "    try: os.killpg(pgid, signal.SIGKILL)\n    except OSError: pass"),
                      (sandbox.Outcome.CRASHED,), -signal.SIGKILL),
}


@pytest.mark.parametrize("target", list(_KILL_LOOPS))
def test_attack_killing_everything_in_a_loop_still_returns_a_result(target):
  code, outcomes, exit_code = _KILL_LOOPS[target]
  bystander = subprocess.Popen(["sleep", "60"])  # a host process of the caller's, which kill(-1) would reach
  try:
    for _ in range(10):  # a race that loses the result one time in a few would show here
      result = _py(code)
      assert result.outcome in outcomes, result
      if exit_code is not None:
        assert result.exit_code == exit_code, result
    assert bystander.poll() is None, "a host process died"
  finally:
    bystander.kill()
    bystander.wait()


def test_attack_signalling_a_host_bystander_and_the_test_process():
  """SIGKILL, SIGTERM and SIGSTOP to a host process of the caller's and to this test process, by pid and group."""
  bystander = subprocess.Popen(["sleep", "60"])
  try:
    code = ("import os, signal\n"
            f"for pid in ({bystander.pid}, {os.getpid()}, -{os.getpgrp()}):\n"
            "  for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):\n"
            "    try: os.kill(pid, sig); print('sent', pid, sig)\n"
            "    except OSError as e: print('denied', pid, e.errno)")
    result = _py(code)
    assert result.outcome == sandbox.Outcome.OK, result.stderr_text
    assert "sent" not in result.stdout_text, result.stdout_text
    assert result.stdout_text.count(f" {errno.ESRCH}\n") == 9, result.stdout_text  # no such pid in its namespace
    assert bystander.poll() is None, "the bystander was killed"
    with open(f"/proc/{bystander.pid}/stat") as f:
      assert f.read().rsplit(")", 1)[1].split()[0] != "T", "the bystander was stopped"
  finally:
    bystander.kill()
    bystander.wait()
  if not ROOT:  # the weaker backend runs as the caller's uid: it can kill the caller's processes
    victim = subprocess.Popen(["sleep", "60"])
    try:
      _weak_py(f"import os\nos.kill({victim.pid}, 9)")
      assert victim.wait(timeout=GONE_WITHIN_S) == -signal.SIGKILL
    finally:
      victim.kill()
      victim.wait()


def test_attack_a_daemon_that_outlives_its_parent():
  """Double fork + setsid leaves a daemon outside the group, holding stdout for longer than the wall clock."""
  # The daemon sends its pid through a pipe and the parent prints it once read: no sleep orders the two.
  code = ("import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n  os.setsid()\n  if os.fork() == 0:\n"
          "    os.write(w, str(os.getpid()).encode())\n    time.sleep(60)\n  os._exit(0)\n"
          "os.wait()\nprint(os.read(r, 32).decode(), flush=True)")
  # Had the run waited for the daemon's stdout, it would have ended at the wall clock as a timeout.
  result = _py(code)
  assert result.outcome == sandbox.Outcome.OK, result.reason
  assert result.stdout_text.strip().isdigit()
  if not ROOT:  # the weaker backend has no uid of the run's own to find the daemon by
    marker = _marker()
    with _weaker():
      sandbox.run(["python3", "-c", f"{code}\n# {marker}"], limits=LIMITS)
    survivors = _marked(marker)
    for pid in survivors:
      os.kill(pid, signal.SIGKILL)
    assert survivors, "the daemon did not outlive a run of the weaker backend"


def _program_runs(marker: str) -> bool:
  """Whether the marked program itself runs, not only bwrap or the sandbox's PID 1 (they carry its argv too)."""
  return any(argv[:2] == [b"python3", b"-c"] for argv in _marked(marker).values())


def test_attack_the_host_process_dies_and_the_program_goes_with_it(tmp_path):
  """The caller of sandbox.run is SIGKILLed mid-run: the program must not live on as an orphan."""
  marker = _marker()
  host_tmp = tmp_path / "host-tmp"
  host_tmp.mkdir()
  # The marker reaches the host process by the environment, so only the sandbox's processes carry it.
  # The program sleeps for 10 minutes and its run would end at 5: both far past the kill below.
  host = ("import os\nfrom ptx.sandbox import run as sandbox\n"
          "code = 'import time\\ntime.sleep(600)\\n# ' + os.environ['PTX_MARK']\n"
          "sandbox.run(['python3', '-c', code], limits=sandbox.Limits(timeout_s=300))")
  proc = subprocess.Popen([sys.executable, "-c", host], cwd=REPO,
                          env={**os.environ, "PTX_MARK": marker, "TMPDIR": str(host_tmp)})
  try:
    # Importing ptx takes seconds on a loaded machine: 2 minutes is ample.
    deadline = time.monotonic() + 120
    while not _program_runs(marker) and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    assert _program_runs(marker), f"the sandboxed program never started (host exit {proc.poll()})"
  finally:
    proc.kill()
    proc.wait()
  assert _survivors(marker, GONE_WITHIN_S) == {}, "the sandboxed program outlived its host process"
  assert list(host_tmp.iterdir()) == []  # nothing of the run, nor root's copy of bwrap, lands in TMPDIR


def _release(fifo: str) -> None:
  """Lets the launch blocked on opening `fifo` go on, once it has opened it (within 2 minutes of a loaded machine)."""
  deadline = time.monotonic() + 120
  while True:
    try:
      fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
      break
    except OSError as e:
      if e.errno != errno.ENXIO or time.monotonic() > deadline:  # ENXIO: no reader yet
        raise
      time.sleep(0.01)
  os.write(fd, b"go\n")
  os.close(fd)


@pytest.fixture
def held_bwrap():
  """A stand-in for bwrap that blocks on a FIFO until the test releases it, then runs the real one: (path, FIFO).

  It holds a launch at a point the test controls, before bwrap has started,
  where a kill of the host process otherwise lands by chance. Under /tmp,
  not TMPDIR: the sandbox's uid must run it.
  """
  held = tempfile.mkdtemp(prefix="ptx-held-bwrap-", dir="/tmp")
  try:
    os.chmod(held, 0o755)
    fifo, wrapper = os.path.join(held, "go"), os.path.join(held, "bwrap")
    os.mkfifo(fifo)
    os.chmod(fifo, 0o666)
    with open(wrapper, "w") as f:
      f.write(f'#!/bin/sh\nread go < {shlex.quote(fifo)}\nexec {shlex.quote(bwrap.binary())} "$@"\n')
    os.chmod(wrapper, 0o755)
    yield wrapper, fifo
  finally:
    workspace_format.remove(held)


def test_attack_the_host_process_dies_while_the_sandbox_starts(held_bwrap, monkeypatch):
  """The caller of sandbox.run is SIGKILLed before bwrap has started: neither bwrap nor the program may live on.

  bwrap then starts with its launcher gone: a --die-with-parent it sets later
  never fires, and it writes the sandbox's pid to a pipe no one reads.
  """
  wrapper, fifo = held_bwrap
  # The stand-in runs a program when its launcher lives on: the FIFO holds it, nothing else.
  monkeypatch.setattr(bwrap, "binary", lambda: wrapper)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    future = pool.submit(sandbox.run, ["python3", "-c", "print('ran')"], limits=LIMITS)
    _release(fifo)
    assert future.result().stdout_text == "ran\n", future.result()
  marker = _marker()
  host = ("import os\nfrom ptx.sandbox import bwrap, run as sandbox\n"
          "sandbox.use('bwrap')\n"  # probed with the real bwrap, before the stand-in takes its place
          "bwrap.binary = lambda: os.environ['PTX_HELD_BWRAP']\n"
          "code = 'import time\\ntime.sleep(600)\\n# ' + os.environ['PTX_MARK']\n"
          "sandbox.run(['python3', '-c', code], limits=sandbox.Limits(timeout_s=300))")
  proc = subprocess.Popen([sys.executable, "-c", host], cwd=REPO,
                          env={**os.environ, "PTX_MARK": marker, "PTX_HELD_BWRAP": wrapper})
  try:
    try:
      deadline, reached = time.monotonic() + 120, {}  # importing ptx takes seconds on a loaded machine
      while not reached and proc.poll() is None and time.monotonic() < deadline:
        reached = _marked(marker)  # kept: read again, a process mid-exec could read as none (`_survivors`)
        time.sleep(0.05)
      assert reached, f"the launch never reached the stand-in (host exit {proc.poll()})"
    finally:
      proc.kill()
      proc.wait()
    _release(fifo)  # bwrap starts now, its launcher dead
    assert _survivors(marker, GONE_WITHIN_S) == {}, "the sandbox outlived the host process that was starting it"
  finally:
    for pid in _marked(marker):
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# Memory, disk and output.


def test_attack_memory_bomb():
  result = _py("a = []\nwhile True: a.append(bytearray(1 << 24))")
  assert result.outcome == sandbox.Outcome.LIMIT, result.reason
  assert "MemoryError" in result.reason


# 8 children of 200 MiB resident each, every one under the 256 MiB per-process limit: 1.6 GiB if
# nothing stops them. The host has 24 GB, and this file may run twice at once (as root and, in
# test_sandbox_unprivileged.py, as nobody), so the worst case stays far below what the host has.
_CHILDREN, _CHILD_BYTES = 8, 200 << 20
_FORK_AND_HOLD = ("import os, time\nfor _ in range({n}):\n  if os.fork() == 0:\n"
                  "    block = bytearray(b'x') * {size}  # every page written: resident, not just reserved\n"
                  "    time.sleep({hold})\n    os._exit(0)\n"
                  "for _ in range({n}): os.wait()")


def test_attack_many_processes_each_under_the_memory_limit():
  """The memory limit holds for the whole run, not per process: the run is stopped, not let take 1.6 GiB."""
  # The children would hold their memory for longer than the wall clock: only the memory limit ends it early.
  result = _py(_FORK_AND_HOLD.format(n=_CHILDREN, size=_CHILD_BYTES, hold=60))
  assert result.outcome == sandbox.Outcome.LIMIT, result
  assert "memory limit of the run" in result.reason
  # The weaker backend limits each process only: the same children all finish. They hold for 0.5 s only,
  # since nothing there stops them taking 1.6 GiB of the host's memory.
  _weak_py(_FORK_AND_HOLD.format(n=_CHILDREN, size=_CHILD_BYTES, hold=0.5))


def test_attack_printing_1gb():
  result = _py("import sys\nfor _ in range(1024): sys.stdout.buffer.write(b'x' * 2**20)")
  assert result.outcome == sandbox.Outcome.LIMIT and result.truncated
  assert len(result.stdout) == LIMITS.output_bytes


def test_attack_children_that_closed_their_output_when_the_host_kills_the_run():
  """10 busy children without stdout or stderr while the parent prints past the cap: none runs once run() returns."""
  code = ("import os, sys\nr, w = os.pipe()\nfor _ in range(10):\n  if os.fork() == 0:\n"
          "    for fd in (0, 1, 2, r): os.close(fd)\n    os.write(w, b'+')\n    while True: pass\n"
          "os.close(w)\nfor _ in range(10): os.read(r, 1)\n"
          "for _ in range(1024): sys.stdout.buffer.write(b'x' * 2**20)")
  for _ in range(10):  # the children outlive run() by milliseconds: nine times in ten here, each time
    assert _py(code).outcome == sandbox.Outcome.LIMIT


@pytest.mark.parametrize("how", ["stream", "sparse"])
def test_attack_writing_a_10gb_file(how):
  """Writes 10 GB in 1 MiB chunks, or seeks to 10 GB and writes one byte."""
  body = ("f.seek(10 * 2**30); f.write(b'x')" if how == "sparse"
          else "for _ in range(10 * 1024): f.write(b'x' * 2**20)")
  result = _py(f"f = open('big', 'wb')\n{body}\nf.close()")
  assert result.outcome == sandbox.Outcome.LIMIT and "File too large" in result.reason


def test_attack_shell_writing_a_10gb_file_is_killed_by_sigxfsz():
  marker = _marker()
  result = sandbox.run(["sh", "-c", f"head -c 10737418240 /dev/zero > big # {marker}"], limits=LIMITS)
  assert result.outcome == sandbox.Outcome.LIMIT, result.reason
  _assert_contained(result, marker)


def _owned_by(uid: int | None, directory: str) -> list[str]:
  return [] if uid is None else [e.name for e in os.scandir(directory) if e.stat(follow_symlinks=False).st_uid == uid]


# Fills /work and /tmp with 1 MiB files (the largest the file limit allows) until it may not,
# reports, and holds them until the host has looked at its disk; first, the device of each directory.
_FILL = """import errno, os
print('devices', os.stat('/work').st_dev, os.stat('/tmp').st_dev)
def fill(directory, size, count):
  made = 0
  try:
    for i in range(count):
      with open(f'{directory}/f{i}', 'wb') as f:
        f.write(b'x' * size)
      made += 1
  except OSError as e:
    print(directory, made, errno.errorcode[e.errno])
    return
  print(directory, made, 'none')
fill('/work', SIZE, COUNT)
fill('/tmp', SIZE, COUNT)
os.write(READY, b'+')
os.read(GO, 1)
"""


@pytest.mark.parametrize("files", ["256 of 1 MiB", "20,000 of 1 byte"])
def test_attack_filling_the_disk(files, monkeypatch, tmp_path):
  """Many files past the size of /work and /tmp (64 MiB each): the program runs out of room, the host never does."""
  size, count = (1 << 20, 256) if files == "256 of 1 MiB" else (1, 20_000)  # a 1-byte file still takes a 4 KiB page
  # Any temporary directory the sandbox made on the host (the weaker backend's ptx-sandbox-*) would be
  # here; the bwrap backend makes none.
  host_tmp = tmp_path / "host-tmp"
  host_tmp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(host_tmp))
  ready_r, ready_w = os.pipe()
  go_r, go_w = os.pipe()
  code = _FILL.replace("SIZE", str(size)).replace("COUNT", str(count))
  code = code.replace("READY", str(ready_w)).replace("GO", str(go_r))
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    future = pool.submit(_py, code, pass_fds=(ready_w, go_r))
    try:
      assert os.read(ready_r, 1) == b"+", "the program did not get to the end of its writes"
      in_host_tmp = list(host_tmp.iterdir())
    finally:
      os.write(go_w, b"+")
      os.close(go_w)
      os.close(ready_r)
    result = future.result()
  assert result.outcome == sandbox.Outcome.OK, result
  # The files lay on filesystems of the sandbox's own (device numbers are the kernel's, in any namespace), none
  # of the host's disks. (The host's free bytes, once compared, moved with other tests' writes.)
  host = {os.stat(path).st_dev for path in ("/", "/tmp", tempfile.gettempdir(), str(tmp_path), os.getcwd())
          + (("/work",) if os.path.isdir("/work") else ())}
  assert not host & {int(dev) for dev in _lines(result)["devices"].split()}, "the program wrote to the host's disk"
  for directory in ("/work", "/tmp"):
    made, error = _lines(result)[directory].split()
    # Past 64 MiB, whatever the file sizes: 65 files of 1 MiB, about 16,000 of one 4 KiB page.
    assert error == "ENOSPC" and int(made) * max(size, 4096) <= LIMITS.disk_bytes, result.stdout_text
  assert in_host_tmp == [] and list(host_tmp.iterdir()) == []
  assert _owned_by(result.uid, "/tmp") == [], "the run left something in the host's /tmp"


def test_attack_writing_to_shared_temporary_directories_leaves_nothing():
  """Drops files in /tmp, /var/tmp and /dev/shm (world-writable on the host); a second run must not see them."""
  name = _marker()
  dirs = ("/tmp", "/var/tmp", "/dev/shm")
  code = f"import os\nfor d in {dirs}:\n  open(os.path.join(d, {name!r}), 'w').write('x')\n  print(d, os.listdir(d))"
  result = _py(code)
  assert result.outcome == sandbox.Outcome.OK, result.stderr_text
  assert result.stdout_text.count(name) == 3
  for d in dirs:
    assert not os.path.exists(os.path.join(d, name)), f"the run left a file in {d}"
  second = _py(f"import os\nfor d in {dirs}: print(d, os.listdir(d))")
  assert second.outcome == sandbox.Outcome.OK and name not in second.stdout_text, second.stdout_text
  if not ROOT:  # the weaker backend's /tmp is the host's when it runs as the caller
    try:
      _weak_py(f"open('/tmp/{name}', 'w').write('x')")
      assert os.path.exists(f"/tmp/{name}")
    finally:
      with contextlib.suppress(FileNotFoundError):
        os.remove(f"/tmp/{name}")


# Workspaces.


def test_workspace_keeps_state_between_runs():
  with sandbox.Workspace({"a.txt": "1\n"}) as ws:
    sandbox.run(["sh", "-c", "cat a.txt > b.txt; echo 2 >> b.txt"], workspace=ws, limits=LIMITS)
    result = sandbox.run(["cat", "b.txt"], workspace=ws, limits=LIMITS)
    assert result.stdout_text == "1\n2\n"
    assert ws.files() == {"a.txt": b"1\n", "b.txt": b"1\n2\n"}
    other = ws.copy()
    ws.write({"a.txt": "changed"})
    assert other.files()["a.txt"] == b"1\n"
    assert (other.uid is None) == (not ROOT) and (not ROOT or other.uid != ws.uid)
  assert ws.files() == {}


_DEEP = "import os\nfor _ in range(3000):\n  os.mkdir('d')\n  os.chdir('d')\nprint('depth', 3000)"


def test_attack_a_3000_deep_directory_chain():
  """Deeper than any recursion limit or PATH_MAX: a throwaway run still returns."""
  result = _py(_DEEP)
  assert result.outcome == sandbox.Outcome.OK and result.stdout_text == "depth 3000\n", result


def test_attack_a_3000_deep_directory_chain_in_a_kept_workspace():
  """A kept workspace is not extended past the format's depth, and it keeps working."""
  with sandbox.Workspace({"keep.txt": "k"}) as ws:
    result = _py(_DEEP, workspace=ws)
    assert result.outcome == sandbox.Outcome.LIMIT and "not kept" in result.reason, result
    assert ws.files() == {"keep.txt": b"k"}
    after = _py("print(open('keep.txt').read(), len(__import__('os').listdir()))", workspace=ws)
    assert after.outcome == sandbox.Outcome.OK and after.stdout_text == "k 1\n", after


def test_attack_sparse_files_in_a_kept_workspace_cannot_make_the_next_run_an_infra_error():
  """9,000 empty 4097-byte files: 37 MB packed, 74 MB of pages unpacked, none used while the program ran."""
  code = ("import os\nfor i in range(9000):\n  fd = os.open(f'f{i}', os.O_WRONLY | os.O_CREAT, 0o644)\n"
          "  os.ftruncate(fd, 4097)\n  os.close(fd)")
  with sandbox.Workspace() as ws:
    _py(code, workspace=ws)
    _py("print(1)", workspace=ws)  # an infra error here would be retried and left out of its group's baseline


# Empty files under 250-byte names 16 levels deep (as deep as a shell's cd goes): about 8 MB of paths in no page.
_LONG_NAMES = "d=$(printf %0250d 0); for i in $(seq 16); do mkdir $d; cd $d; done; seq 2000 | xargs touch"


def test_attack_long_names_cannot_take_a_kept_workspace_past_its_cap():
  """The snapshot's cap counts every byte it stores: names and headers, not just the pages of files."""
  marker = _marker()
  capped = dataclasses.replace(LIMITS, disk_bytes=2 << 20)
  with sandbox.Workspace({"keep.txt": "k"}) as ws:
    before = ws.snapshot
    result = sandbox.run(["sh", "-c", f"{_LONG_NAMES} # {marker}"], workspace=ws, limits=capped)
    _assert_contained(result, marker)
    assert result.outcome == sandbox.Outcome.LIMIT and "not kept" in result.reason, (result, len(ws.snapshot))
    assert ws.snapshot == before


def test_attack_a_workspace_slow_to_unpack_spends_the_runs_own_time():
  """Unpacking what earlier runs left counts against the run's wall clock: past it, the run is a timeout."""
  parts = ["d" * 250] * 60  # 60 levels: each file is created through 60 opened directories
  entries = [("d", "/".join(parts[:i + 1]), 0o755, 0) for i in range(60)]
  entries += [("f", "/".join(parts) + f"/{i}", 0o644, b"") for i in range(3000)]
  with sandbox.Workspace() as ws:
    ws.snapshot = workspace_format.encode(entries)  # about 44 MiB, a second or more to unpack
    result = sandbox.run(["echo", "ran"], workspace=ws, limits=dataclasses.replace(LIMITS, timeout_s=0.1))
  assert result.outcome == sandbox.Outcome.TIMEOUT and result.stdout == b"", result


def test_attack_locking_a_kept_workspace_with_chmod_000():
  """Directories, files and /work itself taken away from everyone: the next run and files() still work."""
  code = ("import os\nos.makedirs('locked/inner')\nopen('locked/inner/f', 'w').write('secret')\n"
          "open('top', 'w').write('t')\n"
          "for p in ('top', 'locked/inner/f', 'locked/inner', 'locked', '.'): os.chmod(p, 0)")
  with sandbox.Workspace() as ws:
    assert _py(code, workspace=ws).outcome == sandbox.Outcome.OK
    assert ws.files() == {"locked/inner/f": b"secret", "top": b"t"}
    ws.write({"new.txt": "n"})
    # The modes are kept (the program chose them); its next run may take them back.
    read = ("import os\nprint(sorted(os.listdir()))\n"
            "for p in ('locked', 'locked/inner', 'locked/inner/f'): os.chmod(p, 0o700)\n"
            "print(open('locked/inner/f').read())")
    after = _py(read, workspace=ws)
    assert after.outcome == sandbox.Outcome.OK, after
    assert after.stdout_text == "['locked', 'new.txt', 'top']\nsecret\n"
    assert sorted(ws.files()) == ["locked/inner/f", "new.txt", "top"]


def test_attack_planting_symlinks_to_host_files_in_a_kept_workspace(tmp_path):
  """Links to host files are kept as links: neither files() nor a later write goes through them."""
  secret = tmp_path / "secret.txt"
  secret.write_text("host-secret-" + secrets.token_hex(4))
  code = (f"import os\nos.symlink({str(secret)!r}, 'host')\nos.symlink('/etc', 'etc')\n"
          "os.symlink('/etc/passwd', 'pw')\nos.mkdir('d')\nos.symlink('..', 'd/up')")
  with sandbox.Workspace() as ws:
    assert _py(code, workspace=ws).outcome == sandbox.Outcome.OK
    assert ws.files() == {}
    for name in ("etc/evil", "d/up/x", "pw", "host"):
      with pytest.raises(ValueError, match="inside the workspace"):
        ws.write({name: "x"})
    after = _py("import os\nprint(os.readlink('host'))\ntry: print(open('host').read())\n"
                "except OSError as e: print('denied', e.errno)", workspace=ws)
    assert after.stdout_text == f"{secret}\ndenied {errno.ENOENT}\n", after
  assert secret.read_text().startswith("host-secret-")


# Other runs.


def test_concurrent_runs_get_distinct_uids_and_private_files():
  """8 runs at once each see only their own files in /work and /tmp, while all of them hold theirs."""
  n = 8
  ready = [os.pipe() for _ in range(n)]
  go = [os.pipe() for _ in range(n)]
  code = ("import os, sys\ntoken = sys.argv[1]\nfor d in ('/work', '/tmp'): open(f'{d}/{token}', 'w').write(token)\n"
          "os.write(int(sys.argv[2]), b'+')\nos.read(int(sys.argv[3]), 1)\n"
          "print(sorted(os.listdir('/work') + os.listdir('/tmp')))")
  tokens = [f"run{i}" for i in range(n)]
  marker = _marker()

  def one(i):
    argv = ["python3", "-c", f"{code}\n# {marker}", tokens[i], str(ready[i][1]), str(go[i][0])]
    return sandbox.run(argv, limits=LIMITS, pass_fds=(ready[i][1], go[i][0]))

  with concurrent.futures.ThreadPoolExecutor(n) as pool:
    futures = [pool.submit(one, i) for i in range(n)]
    try:
      for r, _ in ready:
        assert os.read(r, 1) == b"+", "a run did not write its files"  # now every run holds its files at once
    finally:
      for r, w in go:
        os.write(w, b"+")
        os.close(w)
      for r, _ in ready:
        os.close(r)
    results = [f.result() for f in futures]
  for token, result in zip(tokens, results):
    assert result.outcome == sandbox.Outcome.OK, result
    assert result.stdout_text == f"{[token, token]}\n"
    _assert_contained(result, marker)
  if ROOT:
    assert len({r.uid for r in results}) == n


def _shm_get(key: int) -> int:
  return _libc.shmget(key, 0, 0)


def test_attack_sysv_shared_memory_and_posix_message_queues_across_runs():
  """Run A makes a SysV segment and a POSIX queue; run B, while A holds them, and the host must not find them."""
  key = 1 + secrets.randbelow(2**30)
  queue = f"/{_marker()}".encode()
  prelude = ("import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "rt = libc if hasattr(libc, 'mq_open') else ctypes.CDLL('librt.so.1', use_errno=True)\n"
             "def err(r): return errno.errorcode.get(ctypes.get_errno()) if r < 0 else 'found'\n")
  a_ready_r, a_ready_w = os.pipe()  # A -> host: made
  b_go_r, b_go_w = os.pipe()  # host -> B: look now
  a_done_r, a_done_w = os.pipe()  # B -> A: looked (or EOF: B ended)
  a = (prelude + f"libc.shmat.restype = ctypes.c_void_p\nshm = libc.shmget({key}, 4096, {_IPC_CREAT} | 0o666)\n"
       "assert shm >= 0, ctypes.get_errno()\nctypes.memmove(libc.shmat(shm, None, 0), b'ptx', 3)\n"
       f"mq = rt.mq_open({queue!r}, os.O_CREAT | os.O_RDWR, 0o666, None)\nassert mq >= 0, ctypes.get_errno()\n"
       f"os.write({a_ready_w}, b'+')\nos.read({a_done_r}, 1)\nprint('made')")  # neither removed: the run ends first
  b = (prelude + f"os.read({b_go_r}, 1)\nprint('shm', err(libc.shmget({key}, 0, 0)))\n"
       f"print('mq', err(rt.mq_open({queue!r}, os.O_RDONLY)))\nos.write({a_done_w}, b'+')")
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    run_a = pool.submit(_py, a, pass_fds=(a_ready_w, a_done_r))
    run_b = pool.submit(_py, b, pass_fds=(b_go_r, a_done_w))
    try:
      assert os.read(a_ready_r, 1) == b"+", f"run A could not make them: {run_a.result()}"
      host_shm, host_mq = _shm_get(key), _rt.mq_open(queue, os.O_RDONLY)
    finally:
      os.write(b_go_w, b"+")
      os.close(b_go_w)
      os.close(a_ready_r)
    result_a, result_b = run_a.result(), run_b.result()
  assert result_a.outcome == sandbox.Outcome.OK and result_a.stdout_text == "made\n", result_a
  assert result_b.outcome == sandbox.Outcome.OK, result_b
  assert _lines(result_b) == {"shm": "ENOENT", "mq": "ENOENT"}, result_b.stdout_text
  assert host_shm < 0 and host_mq < 0, "the host sees run A's IPC objects"
  assert _shm_get(key) < 0, "run A's segment outlived it"
  # The weaker backend shares the host's IPC namespace: a segment it makes is the host's (and outlives it).
  _weak_py(f"import ctypes\nassert ctypes.CDLL(None).shmget({key}, 4096, {_IPC_CREAT} | 0o600) >= 0")
  shm = _shm_get(key)
  assert shm >= 0, "the weaker backend's segment did not reach the host"
  _libc.shmctl(shm, _IPC_RMID, None)


# Host processes, files and network.


def test_attack_reading_host_processes_cmdline_and_environ(monkeypatch):
  """A host process with a secret argument and environment, and this process's own environment."""
  marker, secret = _marker(), f"ptx-secret-{secrets.token_hex(8)}"
  monkeypatch.setenv("PTX_TEST_SECRET", secret)
  host = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", marker], stdin=subprocess.PIPE,
                          env={"PTX_HOST_SECRET": secret})
  try:
    # It names the host pids but never holds the marker or the secret itself; it prints only what looks like
    # either (a host has too many processes to print all they hold under the output cap).
    code = ("import glob, os, re\nprint(dict(os.environ))\n"
            "needle = re.compile(rb'ptx-(?:attack|secret)-[0-9a-f]{16}')\n"
            "paths = glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ')\n"
            f"paths += [f'/proc/{{p}}/{{n}}' for p in ({host.pid}, {os.getpid()}) for n in ('cmdline', 'environ')]\n"
            "read = 0\nfor p in paths:\n  try: data = open(p, 'rb').read()\n  except OSError: continue\n"
            "  read += 1\n  if found := needle.findall(data): print(p, found)\nprint('read', read)")
    result = _py(code)
    assert result.outcome == sandbox.Outcome.OK, result.stderr_text
    assert int(_lines(result)["read"]) > 0, "it could not read even its own namespace's /proc"
    for needle in (marker, secret):
      assert needle not in result.stdout_text and needle not in result.stderr_text
    # The weaker backend sees the host's /proc: command lines are world-readable there.
    assert marker in _weak_py(code).stdout_text
  finally:
    host.communicate(b"")


def test_attack_reading_world_readable_host_files(tmp_path):
  """The repository, /root, /home, the test's tmp_path and a world-readable file in the host's /tmp."""
  repo_file = pathlib.Path(sandbox.__file__).resolve()
  in_tmp = pathlib.Path(tempfile.mkdtemp())
  try:
    in_tmp.chmod(0o755)
    (in_tmp / "f").write_text("host /tmp file")
    (tmp_path / "f").write_text("tmp_path file")
    targets = [str(repo_file), str(REPO), "/root", "/home", str(tmp_path / "f"), str(in_tmp / "f")]
    code = (f"import os\nfor p in {targets!r}:\n"
            "  try: print(p, 'read', os.listdir(p) if os.path.isdir(p) else open(p).read(9))\n"
            "  except OSError as e: print(p, 'denied', e.errno)\n"
            "print('/ holds', sorted(os.listdir('/')))")
    result = _py(code)
    assert result.outcome == sandbox.Outcome.OK, result.stderr_text
    seen = _lines(result)
    for p in targets:
      assert seen[p] == f"denied {errno.ENOENT}", result.stdout_text  # none of them exists in the sandbox
    # Only the read-only system, its own /proc, /dev and tmpfs mounts (and the links to them).
    allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr", "var", "work"}
    assert set(ast.literal_eval(seen["/"].removeprefix("holds "))) <= allowed, result.stdout_text
    if not ROOT:  # the weaker backend, run as the caller, sees the caller's files
      assert _lines(_weak_py(code))[str(repo_file)].startswith("read"), "the weaker backend hid the repository"
  finally:
    (in_tmp / "f").unlink()
    in_tmp.rmdir()


def test_attack_writing_to_the_system_directories():
  """Creates files in /usr, /etc and /usr/bin, a directory in /usr/lib; opens /etc/passwd to append (writes nothing)."""
  name = _marker()
  targets = [f"/usr/{name}", f"/etc/{name}", f"/usr/bin/{name}"]
  code = (f"import os\nfor p in {targets!r}:\n"
          "  try: open(p, 'x').close(); print(p, 'made')\n  except OSError as e: print(p, e.errno)\n"
          f"try: os.mkdir('/usr/lib/{name}'); print('mkdir made')\nexcept OSError as e: print('mkdir', e.errno)\n"
          "try: open('/etc/passwd', 'ab').close(); print('passwd opened')\n"
          "except OSError as e: print('passwd', e.errno)\n"
          "try: os.utime('/etc/hostname'); print('utime done')\nexcept OSError as e: print('utime', e.errno)")
  try:
    result = _py(code)
    assert result.outcome == sandbox.Outcome.OK, result.stderr_text
    lines = _lines(result)
    # Read-only mounts; opening a root-owned file to write fails for want of permission first.
    assert lines.pop("passwd") in (str(errno.EROFS), str(errno.EACCES)), result.stdout_text
    assert len(lines) == 5 and set(lines.values()) == {str(errno.EROFS)}, result.stdout_text
    for p in (*targets, f"/usr/lib/{name}"):
      assert not os.path.exists(p)
  finally:
    for p in targets:
      with contextlib.suppress(FileNotFoundError):
        os.remove(p)
    with contextlib.suppress(FileNotFoundError):
      os.rmdir(f"/usr/lib/{name}")


def test_attack_devices_and_the_hostname():
  """Opens host disks and kernel devices, and renames the machine (its own UTS namespace, without the right)."""
  hostname = socket.gethostname()
  code = ("import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "print('sethostname', libc.sethostname(b'pwned', 5), ctypes.get_errno())\n"
          "print('name', socket.gethostname())\nprint('dev', sorted(os.listdir('/dev')))\n"
          "for p in ('/dev/mem', '/dev/kmsg', '/dev/vda', '/dev/sda', '/dev/nvme0n1', '/dev/fuse'):\n"
          "  try: open(p, 'rb').close(); print(p, 'opened')\n  except OSError as e: print(p, e.errno)")
  result = _py(code)
  lines = _lines(result)
  assert lines.pop("sethostname") == f"-1 {errno.EPERM}" and lines.pop("name") == "sandbox", result.stdout_text
  minimal = {"console", "core", "fd", "full", "mqueue", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin",
             "stdout", "tty", "urandom", "zero"}
  assert set(ast.literal_eval(lines.pop("dev"))) <= minimal, result.stdout_text
  assert set(lines.values()) == {str(errno.ENOENT)}, result.stdout_text
  assert socket.gethostname() == hostname


def _connect_code(port: int, *, out: bool) -> str:
  """A program that connects to the host's localhost `port` (and out, by address and by name, when `out`)."""
  addrs = [("127.0.0.1", port)] + ([("1.1.1.1", 53), ("8.8.8.8", 443)] if out else [])
  # Without a route a connection fails at once; the 5 s timeout only bounds one that would hang.
  code = (f"import socket\nfor addr in {addrs!r}:\n"
          "  try: socket.create_connection(addr, timeout=5).close(); print(addr[0], 'connected')\n"
          "  except OSError as e: print(addr[0], e.errno)\n")
  if out:
    code += ("try: print('lookup', socket.getaddrinfo('example.com', 443)[0][4])\n"
             "except OSError as e: print('lookup failed', e.errno)\n"
             "print('interfaces', [n for _, n in socket.if_nameindex()])")
  return code


def test_attack_the_network():
  """A listener on the host's localhost, connections out by address, and a name lookup."""
  with socket.socket() as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    result = _py(_connect_code(port, out=True))
    assert result.network_isolated
    with pytest.raises(BlockingIOError):
      listener.accept()
    lines = _lines(result)
    assert lines["127.0.0.1"] == str(errno.ECONNREFUSED), result.stdout_text  # its own loopback, with no listener
    for addr in ("1.1.1.1", "8.8.8.8"):
      assert lines[addr] == str(errno.ENETUNREACH), result.stdout_text  # no other interface, no route
    assert lines["lookup"].startswith("failed") and lines["interfaces"] == "['lo']", result.stdout_text
    # The same program with the network left on reaches the listener: the check above can fail.
    connected = _py(_connect_code(port, out=False), cut_network=False)
    assert _lines(connected)["127.0.0.1"] == "connected" and not connected.network_isolated
    listener.setblocking(True)
    listener.accept()[0].close()


# The kernel's attack surface.


# x86_64 numbers; arguments that succeed without the filter where they can (PTRACE_TRACEME,
# unshare(0), reading its own memory, its own session keyring, a one-entry io_uring).
_SYSCALLS = """import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(16)
class Iov(ctypes.Structure): _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]
iov = Iov(ctypes.addressof(buf), 16)
params = ctypes.create_string_buffer(120)
calls = {'ptrace': (101, 0, 0, 0, 0),
         'process_vm_readv': (310, os.getpid(), ctypes.byref(iov), 1, ctypes.byref(iov), 1, 0),
         'keyctl': (250, 0, ctypes.c_long(-3), 0), 'bpf': (321, 0, 0, 0), 'unshare': (272, 0),
         'mount': (165, b'none', b'/tmp', b'tmpfs', 0, 0), 'io_uring_setup': (425, 1, params),
         'perf_event_open': (298, 0, 0, -1, -1, 0), 'userfaultfd': (323, 0), 'setns': (308, 0, 0)}
for name, (nr, *args) in calls.items():
  r = libc.syscall(nr, *args)
  print(name, errno.errorcode.get(ctypes.get_errno(), '?') if r < 0 else 'ok')
"""


def test_attack_system_calls_the_filter_refuses():
  result = _py(_SYSCALLS)
  assert result.outcome == sandbox.Outcome.OK, result.stderr_text
  lines = _lines(result)
  assert len(lines) == 10 and set(lines.values()) == {"EPERM"}, result.stdout_text
  # Without the filter (the weaker backend) these succeed.
  weak = _lines(_weak_py(_SYSCALLS))
  assert {n: weak[n] for n in ("ptrace", "unshare", "keyctl", "io_uring_setup")} == dict.fromkeys(
      ("ptrace", "unshare", "keyctl", "io_uring_setup"), "ok"), weak


# A raw clone(2) is no seccomp-refused call: --disable-userns is what stops it. Its child returns 0
# into this same interpreter, which it leaves at once.
_NEW_USERNS = f"""import ctypes, errno, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
pid = libc.syscall(56, {_CLONE_NEWUSER} | 17, 0, 0, 0, 0)
if pid == 0: os._exit(0)
print('clone', 'made' if pid > 0 else errno.errorcode.get(ctypes.get_errno()))
if pid > 0: os.waitpid(pid, 0)
r = subprocess.run(['unshare', '-U', 'true'], capture_output=True)
print('unshare-U', r.returncode)
print('unshare', libc.unshare({_CLONE_NEWUSER}), errno.errorcode.get(ctypes.get_errno()))  # last: it would move us
"""


def test_attack_creating_a_user_namespace():
  result = _py(_NEW_USERNS)
  assert result.outcome == sandbox.Outcome.OK, result.stderr_text
  lines = _lines(result)
  assert lines["unshare"] == "-1 EPERM" and lines["clone"] in ("EPERM", "ENOSPC"), result.stdout_text
  assert lines["unshare-U"] != "0", result.stdout_text
  if not ROOT:  # the weaker backend chroots a root caller's runs, and a chroot may not make one either
    assert _lines(_weak_py(_NEW_USERNS))["clone"] == "made", "the weaker backend refused a user namespace too"


_NO_NEW_PRIVS = "print('nnp', open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0])"
# Runs every setuid binary (with --help) and reads the uids it ran with from its zombie, before reaping it.
_SETUID = _NO_NEW_PRIVS + """
import os, stat, subprocess
euids = {}
for d in ('/usr/bin', '/usr/sbin', '/usr/lib/openssh', '/usr/lib/dbus-1.0', '/usr/lib/polkit-1'):
  for e in os.scandir(d) if os.path.isdir(d) else ():
    mode = e.stat(follow_symlinks=False).st_mode
    if stat.S_ISREG(mode) and mode & stat.S_ISUID and mode & stat.S_IXOTH:  # others may run it
      p = subprocess.Popen([e.path, '--help'], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
      os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
      with open(f'/proc/{p.pid}/status') as f:
        euids[e.name] = [l.split()[2] for l in f if l.startswith('Uid:')][0]
      p.wait()
print('euids', euids)
r = subprocess.run(['su', 'root', '-c', 'id -u'], stdin=subprocess.DEVNULL, capture_output=True, text=True)
print('su', r.returncode, r.stdout.strip() or '-')
"""


def test_attack_setuid_binaries_do_not_elevate():
  result = _py(_SETUID)
  assert result.outcome == sandbox.Outcome.OK, result.stderr_text
  lines = _lines(result)
  assert lines["nnp"] == "1", result.stdout_text
  euids = ast.literal_eval(lines["euids"])
  assert "su" in euids and set(euids.values()) == {"1000"}, result.stdout_text  # as they were started
  assert lines["su"].split()[0] != "0" and lines["su"].split()[1] != "0", result.stdout_text
  # The weaker backend sets no no_new_privs.
  assert _lines(_weak_py(_NO_NEW_PRIVS))["nnp"] == "0"


# The run's result.


# The report it would forge, in the encodings a launcher has used for it (JSON lines, marshal records).
_FORGE = """import ctypes, glob, json, marshal, os, sys
libc = ctypes.CDLL(None, use_errno=True)
report = {'started': True, 'exit': 0, 'killed': '', 'exec_error': 'forged', 'setup_error': 'forged'}
forged = (json.dumps(report) + '\\n').encode() + marshal.dumps(report, 4)
wrote = []
for fd in range(3, 65):
  try: os.write(fd, forged); wrote.append(fd)
  except OSError: pass
for p in glob.glob('/proc/1/fd/*') + [f'/proc/1/fd/{n}' for n in range(3, 65)]:
  try:
    with open(p, 'wb') as f: f.write(forged)
    wrote.append(p)
  except OSError: pass
print('wrote', wrote)
print('fds', glob.glob('/proc/1/fd/*'))
try: open('/proc/1/mem', 'rb').read(1); print('mem read')
except OSError as e: print('mem', e.errno)
for request in (16, 0x4206):  # PTRACE_ATTACH, PTRACE_SEIZE
  print('ptrace', request, libc.syscall(101, request, 1, 0, 0), ctypes.get_errno())
sys.exit(5)
"""


def test_attack_forging_the_result():
  """Writes a report claiming success (or an infra error) to every descriptor and to PID 1's; reads PID 1's memory."""
  result = _py(_FORGE)
  assert result.outcome == sandbox.Outcome.FAILED and result.exit_code == 5, result
  lines = _lines(result)
  assert lines["wrote"] == "[]" and lines["fds"] == "[]", result.stdout_text
  assert lines["mem"] == str(errno.EACCES), result.stdout_text
  ptrace = [line for line in result.stdout_text.splitlines() if line.startswith("ptrace")]
  assert ptrace == [f"ptrace 16 -1 {errno.EPERM}", f"ptrace {0x4206} -1 {errno.EPERM}"], result.stdout_text


def test_a_run_whose_exit_and_bwrap_info_come_in_one_poll_returns_its_result(monkeypatch):
  """On a loaded host one poll may bring bwrap's exit before its info: the exit drains the info first."""
  collect = capture.Capture.collect

  class ExitFirst:
    """The capture's selector, returning the exit ahead of everything else in a batch."""

    def __init__(self, sel, pid):
      self.sel, self.pid = sel, pid

    def select(self, timeout=None):
      os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: as if the loop were slow
      return sorted(self.sel.select(timeout), key=lambda event: event[0].data != "exit")

    def __getattr__(self, name):
      return getattr(self.sel, name)

  def exit_first(self, deadline):
    self.sel = ExitFirst(self.sel, self.proc.pid)
    return collect(self, deadline)

  monkeypatch.setattr(capture.Capture, "collect", exit_first)
  assert sandbox.run(["true"], limits=LIMITS).outcome == sandbox.Outcome.OK
