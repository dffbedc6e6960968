"""ForkServer: a trusted program run in forks of one long-lived sandbox, each fork with its own I/O and limits."""

import os
import threading

import pytest

from ptx.sandbox import fork_server, run as sandbox

# Module-level TOKEN is drawn once per server (at its import), so forks of one server share it.
PROGRAM = '''
import os, sys, time
TOKEN = os.urandom(8).hex()

def main():
  data = sys.stdin.buffer.read()
  command, _, rest = data.partition(b" ")
  if command == b"echo":
    for fd in sys.argv[1:]:
      os.write(int(fd), rest)
    sys.stdout.write(f"{TOKEN} {len(rest)} {sys.argv[1:]}")
  elif command == b"fds":
    print(sorted(int(fd) for fd in os.listdir("/proc/self/fd")))
  elif command == b"exit":
    sys.exit(int(rest))
  elif command == b"raise":
    raise ValueError("asked to")
  elif command == b"spin":
    while True:
      pass
  elif command == b"sleep":
    time.sleep(float(rest))
    print(TOKEN)
  elif command == b"hold":
    os.write(3, b"started")
    time.sleep(1)
    print(TOKEN)
  elif command == b"allocate":
    blob = bytearray(int(rest))
  elif command == b"print":
    sys.stdout.write("x" * int(rest))
  elif command == b"host":
    interfaces = sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:])
    print(os.getuid(), os.path.exists(rest.decode()), interfaces)
  elif command == b"kill-server":
    os.kill(os.getppid(), 9)
    time.sleep(30)
'''
LIMITS = sandbox.Limits(timeout_s=20.0, cpu_s=2, memory_bytes=256 << 20, output_bytes=4096)


@pytest.fixture(scope="module")
def server():
  fs = fork_server.ForkServer("program.py", {"program.py": PROGRAM})
  yield fs
  fs.close()


def test_each_run_gets_its_stdin_its_pipes_as_arguments_and_its_output(server):
  r, w = os.pipe()
  result = server.run(stdin=b"echo hello", pass_fds=[w], limits=LIMITS)
  assert result.outcome == sandbox.Outcome.OK and result.exit_code == 0, result
  token, size, fds = result.stdout_text.split(" ", 2)
  assert size == "5" and fds == "['3']" and os.read(r, 100) == b"hello"
  # EOF: no copy of the write end is left open, so the host (run owns what it sent), the server and the fork
  # closed theirs.
  assert os.read(r, 100) == b""
  os.close(r)
  assert result.backend == str(sandbox.backend()) and result.usage.wall_s < LIMITS.timeout_s


def test_a_large_stdin_arrives_whole(server):
  result = server.run(stdin=b"echo " + b"y" * (3 << 20), limits=LIMITS)
  assert result.outcome == sandbox.Outcome.OK and result.stdout_text.split()[1] == str(3 << 20)


def test_forks_hold_no_descriptor_but_their_own(server):
  r1, w1 = os.pipe()
  r2, w2 = os.pipe()
  blocker = threading.Thread(target=server.run, kwargs={"stdin": b"hold", "pass_fds": [w1], "limits": LIMITS})
  blocker.start()
  # In flight: its status pipe and pidfd are the loop's, and must not leak into the next fork.
  assert os.read(r1, 10) == b"started"
  result = server.run(stdin=b"fds", pass_fds=[w2], limits=LIMITS)
  blocker.join()
  # 0-2, the pipe at 3, and the directory listdir opened.
  assert result.outcome == sandbox.Outcome.OK and eval(result.stdout_text) == [0, 1, 2, 3, 4], result
  for fd in (r1, r2):
    assert os.read(fd, 10) == b""
    os.close(fd)


@pytest.mark.parametrize("command, outcome, reason", [
    (b"exit 3", sandbox.Outcome.FAILED, "exit 3"),
    (b"raise", sandbox.Outcome.FAILED, "exit 1"),
    (b"spin", sandbox.Outcome.LIMIT, "2 s CPU limit"),
    (b"allocate 1000000000", sandbox.Outcome.LIMIT, "MemoryError"),
    (b"print 5000", sandbox.Outcome.LIMIT, "4096-byte output cap"),
])
def test_each_fork_is_held_to_its_own_limits(server, command, outcome, reason):
  result = server.run(stdin=command, limits=LIMITS)
  assert result.outcome == outcome and reason in result.reason, result
  if command == b"raise":
    assert "ValueError: asked to" in result.stderr_text
  if command.startswith(b"print"):
    assert result.truncated and len(result.stdout) == 4096


def test_a_fork_past_its_deadline_is_killed_and_the_server_lives_on(server):
  result = server.run(stdin=b"sleep 60", limits=sandbox.Limits(timeout_s=0.5))
  assert result.outcome == sandbox.Outcome.TIMEOUT and "0.5 s wall-clock" in result.reason
  assert server.run(stdin=b"echo again", limits=LIMITS).outcome == sandbox.Outcome.OK


def test_concurrent_runs_from_many_threads_each_get_their_own_answer(server):
  answers = {}

  def one(i):
    answers[i] = server.run(stdin=b"echo " + b"z" * i, limits=LIMITS)

  threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert all(answers[i].outcome == sandbox.Outcome.OK and answers[i].stdout_text.split()[1] == str(i)
             for i in range(24))
  assert len({a.stdout_text.split()[0] for a in answers.values()}) == 1  # one server forked them all


def test_the_server_is_confined_like_any_sandbox_run(server):
  result = server.run(stdin=b"host " + os.path.abspath(__file__).encode(), limits=LIMITS)
  uid, sees_this_file, interfaces = result.stdout_text.split(" ", 2)
  if sandbox.backend() == sandbox.Backend.BWRAP:
    assert (uid, sees_this_file, interfaces.strip()) == ("1000", "False", "['lo']"), result


def test_a_dead_server_fails_its_runs_as_infra_and_the_next_run_starts_another():
  fs = fork_server.ForkServer("program.py", {"program.py": PROGRAM})
  try:
    first = fs.run(stdin=b"echo a", limits=LIMITS).stdout_text.split()[0]
    lost = fs.run(stdin=b"kill-server", limits=LIMITS)
    assert lost.outcome == sandbox.Outcome.INFRA_ERROR and "fork server ended" in lost.reason, lost
    again = fs.run(stdin=b"echo b", limits=LIMITS)
    assert again.outcome == sandbox.Outcome.OK and again.stdout_text.split()[0] != first
  finally:
    fs.close()


def test_close_lets_runs_in_flight_finish_and_the_next_run_gets_a_fresh_server():
  fs = fork_server.ForkServer("program.py", {"program.py": PROGRAM})
  try:
    first = fs.run(stdin=b"echo a", limits=LIMITS).stdout_text.split()[0]
    done, (r, w) = {}, os.pipe()
    slow = threading.Thread(target=lambda: done.update(r=fs.run(stdin=b"hold", pass_fds=[w], limits=LIMITS)))
    slow.start()
    assert os.read(r, 10) == b"started"  # the fork is running
    os.close(r)
    fs.close()
    slow.join()
    assert done["r"].outcome == sandbox.Outcome.OK and done["r"].stdout_text.split()[0] == first, done["r"]
    assert fs.run(stdin=b"echo b", limits=LIMITS).stdout_text.split()[0] != first
  finally:
    fs.close()


def test_bad_requests_name_the_field_and_close_what_was_passed():
  with pytest.raises(ValueError, match="program 'missing.py' is not among files"):
    fork_server.ForkServer("missing.py", {"program.py": PROGRAM})
  fs = fork_server.ForkServer("program.py", {"program.py": PROGRAM})
  r, w = os.pipe()
  with pytest.raises(ValueError, match="timeout_s 1000000.0 is past half a server"):
    fs.run(stdin=b"echo", pass_fds=[w], limits=sandbox.Limits(timeout_s=1e6))
  assert os.read(r, 10) == b""
  os.close(r)
