"""Adversarial tests of ptx.rl.sandbox: each attack is contained, host unharmed.

Every attack runs under small limits (1-2 s) and ends with `_assert_contained`:
no process of the run's uid is left alive and this test process still runs.
"""

import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import threading

import pytest

from ptx.rl import sandbox, strays

# The wall clock is generous so a loaded machine cannot turn a limit into a
# timeout; the attacks that only a timeout stops set a short one themselves.
LIMITS = sandbox.Limits(timeout_s=20.0, cpu_s=1, memory_bytes=256 << 20, file_bytes=1 << 20,
                        processes=16, open_files=32, output_bytes=1 << 16)
SHORT = dataclasses.replace(LIMITS, timeout_s=1.5)
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="only root gets a private uid per run")


def _py(code: str, **kwargs) -> sandbox.SandboxResult:
  return sandbox.run(["python3", "-c", code], limits=kwargs.pop("limits", LIMITS), **kwargs)


def _assert_contained(result: sandbox.SandboxResult) -> None:
  if result.uid is not None:
    assert strays.live_pids(result.uid) == [], "a process of the run survived it"
  os.kill(os.getpid(), 0)  # the test process is alive


@pytest.fixture(scope="module", autouse=True)
def _python_in_sandbox():
  result = sandbox.run(["python3", "-c", "print(1)"], limits=LIMITS)
  if result.outcome == sandbox.Outcome.INFRA_ERROR:
    pytest.skip(f"no python3 the sandbox can run: {result.reason}")


def test_ok_run_reports_output_usage_and_isolation():
  result = _py("import os, sys; print(sorted(os.environ)); sys.stderr.write('e')")
  assert result.outcome == sandbox.Outcome.OK and result.exit_code == 0
  assert result.stderr == b"e"
  assert result.usage.wall_s > 0 and result.usage.max_rss_bytes > 0
  if ROOT:
    assert result.network_isolated and result.uid is not None and result.notes == ()
  _assert_contained(result)


def test_nonzero_exit_is_failed_and_segfault_is_crashed():
  assert _py("import sys; sys.exit(3)").outcome == sandbox.Outcome.FAILED
  crashed = _py("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
  assert crashed.outcome == sandbox.Outcome.CRASHED and crashed.exit_code == -signal.SIGSEGV


def test_files_stdin_and_extra_env_reach_the_program():
  main = "import os, sys\nd = sys.stdin.read()\nprint(len(d), d[-2:], os.environ['MODE'])"
  result = sandbox.run(["python3", "main.py"], files={"main.py": main}, stdin="x" * 200_000 + "ab",
                       env={"MODE": "m"}, limits=LIMITS)
  assert result.outcome == sandbox.Outcome.OK, result.stderr_text
  assert result.stdout_text == "200002 ab m\n"


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


def test_attack_fork_bomb():
  """Forks until RLIMIT_NPROC refuses, in every child, forever."""
  result = _py("import os\nwhile True:\n  try: os.fork()\n  except OSError: pass", limits=SHORT)
  assert result.outcome in (sandbox.Outcome.TIMEOUT, sandbox.Outcome.LIMIT), result.reason
  _assert_contained(result)


def test_attack_infinite_busy_loop_hits_the_cpu_limit():
  result = _py("while True: pass")
  assert result.outcome == sandbox.Outcome.LIMIT and "CPU" in result.reason
  _assert_contained(result)


def test_attack_infinite_sleeping_loop_hits_the_wall_clock():
  result = _py("import time\nwhile True: time.sleep(1)", limits=SHORT)
  assert result.outcome == sandbox.Outcome.TIMEOUT
  _assert_contained(result)


def test_attack_memory_bomb():
  result = _py("a = []\nwhile True: a.append(bytearray(1 << 24))")
  assert result.outcome == sandbox.Outcome.LIMIT, result.reason
  assert "MemoryError" in result.reason
  _assert_contained(result)


@pytest.mark.parametrize("how", ["stream", "sparse"])
def test_attack_writing_a_10gb_file(how):
  """Writes 10 GB in 1 MiB chunks, or seeks to 10 GB and writes one byte."""
  body = ("f.seek(10 * 2**30); f.write(b'x')" if how == "sparse"
          else "for _ in range(10 * 1024): f.write(b'x' * 2**20)")
  result = _py(f"f = open('big', 'wb')\n{body}\nf.close()")
  assert result.outcome == sandbox.Outcome.LIMIT and "File too large" in result.reason
  _assert_contained(result)


def test_attack_shell_writing_a_10gb_file_is_killed_by_sigxfsz():
  result = sandbox.run(["sh", "-c", "head -c 10737418240 /dev/zero > big"], limits=LIMITS)
  assert result.outcome == sandbox.Outcome.LIMIT, result.reason
  _assert_contained(result)


def test_attack_connecting_to_a_listener_on_localhost():
  with socket.socket() as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    result = _py("import socket\ntry:\n"
                 f"  socket.create_connection(('127.0.0.1', {port}), timeout=1); print('connected')\n"
                 "except OSError as e: print('refused', e)")
    if not result.network_isolated:
      pytest.skip(f"this OS gave no network namespace: {result.notes}")
    with pytest.raises(BlockingIOError):
      listener.accept()
  assert result.stdout_text.startswith("refused"), result.stdout_text
  _assert_contained(result)


@needs_root
def test_attack_reading_the_parents_environment_secrets(monkeypatch):
  secret = "ptx-secret-7f3a9c"
  monkeypatch.setenv("PTX_TEST_SECRET", secret)
  code = ("import os, glob\nprint(dict(os.environ))\n"
          "for p in [f'/proc/{os.getppid()}/environ'] + glob.glob('/proc/*/environ'):\n"
          "  try: print(open(p, 'rb').read())\n  except OSError: pass")
  result = _py(code)
  assert result.outcome == sandbox.Outcome.OK, result.stderr_text
  assert secret not in result.stdout_text and secret not in result.stderr_text
  _assert_contained(result)


@needs_root
def test_attack_killing_the_parent():
  """SIGKILL to the parent, its process group, a bystander, and kill(-1)."""
  bystander = subprocess.Popen(["sleep", "30"])
  try:
    code = ("import os, signal\n"
            f"for pid in (os.getppid(), -os.getpgid(os.getppid()), {bystander.pid}, -1):\n"
            "  try: os.kill(pid, signal.SIGKILL); print('killed', pid)\n"
            "  except OSError as e: print('denied', pid, e.errno)")
    result = _py(code)
    assert bystander.poll() is None, "the bystander was killed"
  finally:
    bystander.kill()
    bystander.wait()
  assert "killed" not in result.stdout_text.replace("killed -1", ""), result.stdout_text
  _assert_contained(result)


@needs_root
def test_attack_a_child_that_outlives_its_parent():
  """Double fork + setsid leaves a daemon outside the group, holding stdout."""
  # The daemon sends its pid through a pipe and the parent prints it once read: no sleep orders the two.
  code = ("import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n  os.setsid()\n  if os.fork() == 0:\n"
          "    os.write(w, str(os.getpid()).encode())\n    time.sleep(60)\n  os._exit(0)\n"
          "os.wait()\nprint(os.read(r, 32).decode(), flush=True)")
  result = _py(code)
  assert result.outcome == sandbox.Outcome.OK, result.reason
  daemon = int(result.stdout_text.split()[0])
  assert daemon not in strays.live_pids(result.uid)
  # Not a speed claim: waiting for the daemon's stdout would have run into the wall-clock limit itself.
  assert result.usage.wall_s < LIMITS.timeout_s, "the sandbox waited for the daemon"
  _assert_contained(result)


def test_attack_printing_1gb():
  result = _py("import sys\nfor _ in range(1024): sys.stdout.buffer.write(b'x' * 2**20)")
  assert result.outcome == sandbox.Outcome.LIMIT and result.truncated
  assert len(result.stdout) == LIMITS.output_bytes
  _assert_contained(result)


@needs_root
def test_attack_deleting_files_outside_its_directory(tmp_path):
  """Deletes, overwrites and plants a symlink for the cleanup to follow."""
  victim_dir = pathlib.Path(tmp_path / "victim")
  victim_dir.mkdir()
  for path in (tmp_path, victim_dir):
    path.chmod(0o777)  # world-writable, so only the sticky bit or ownership can stop it
  victim_dir.chmod(0o1777)
  victim = victim_dir / "keep.txt"
  victim.write_text("keep")
  code = (f"import os, shutil\nv = {str(victim)!r}\n"
          "for attack in (lambda: os.remove(v), lambda: open(v, 'w').write('gone'),\n"
          "               lambda: shutil.rmtree(os.path.dirname(v)), lambda: os.remove('/etc/hostname')):\n"
          "  try: attack()\n  except OSError as e: print('denied', e.errno)\n"
          "os.symlink(os.path.dirname(v), 'link')")
  result = _py(code)
  assert victim.read_text() == "keep" and pathlib.Path("/etc/hostname").exists()
  assert result.stdout_text.count("denied") == 4, result.stdout_text
  _assert_contained(result)


@needs_root
def test_attack_writing_to_shared_temporary_directories_leaves_nothing():
  """Drops files in /tmp, /var/tmp and /dev/shm (world-writable on the host)."""
  name = f"ptx-sandbox-escape-{os.getpid()}"
  code = (f"import os\nfor d in ('/tmp', '/var/tmp', '/dev/shm'):\n  open(os.path.join(d, {name!r}), 'w').write('x')\n"
          "print(os.listdir('/tmp'))")
  result = _py(code)
  assert result.outcome == sandbox.Outcome.OK, result.stderr_text
  assert name in result.stdout_text and result.notes == ()
  for d in ("/tmp", "/var/tmp", "/dev/shm"):
    assert not os.path.exists(os.path.join(d, name)), f"the run left a file in {d}"
  _assert_contained(result)


@needs_root
def test_attack_reading_world_readable_host_files():
  """Reads this repository (world-readable on the host) and lists the root."""
  repo_file = pathlib.Path(sandbox.__file__).resolve()
  assert repo_file.stat().st_mode & 0o004
  repo_dir = repo_file.parents[2]  # the checkout, wherever it lives (/work, /tmp, /home)
  code = (f"import os\ntry: print(open({str(repo_file)!r}).read()[:20])\n"
          "except OSError as e: print('denied', e.errno)\n"
          f"print(os.path.exists({str(repo_dir)!r}), sorted(os.listdir('/')))")
  result = _py(code)
  assert result.outcome == sandbox.Outcome.OK, result.stderr_text
  assert result.stdout_text.startswith("denied"), result.stdout_text
  # The checkout is invisible; a /tmp the sandbox lists is its own private one.
  assert "\nFalse " in result.stdout_text and "'root'" not in result.stdout_text, result.stdout_text
  _assert_contained(result)


@needs_root
def test_concurrent_runs_get_distinct_uids_and_workspaces():
  results = [None] * 8

  def one(i):
    results[i] = _py("import os; print(os.getuid(), os.getcwd())")

  threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert all(r.outcome == sandbox.Outcome.OK for r in results)
  assert len({r.stdout_text for r in results}) == 8


def test_workspace_keeps_state_between_runs():
  with sandbox.Workspace({"a.txt": "1\n"}) as ws:
    sandbox.run(["sh", "-c", "cat a.txt > b.txt; echo 2 >> b.txt"], workspace=ws, limits=LIMITS)
    result = sandbox.run(["cat", "b.txt"], workspace=ws, limits=LIMITS)
    path = ws.path
  assert result.stdout_text == "1\n2\n"
  assert not path.exists()
