"""The first process inside a bubblewrap sandbox: unpack, run the program, watch it, pack.

Never imported. `ptx.sandbox.bwrap` runs it as PID 1 of the sandbox's PID
namespace (`bwrap --as-pid-1`) with `python3 -I -S -c`, after a bootstrap that
makes `workspace` importable from its source. Its configuration is one
argument, marshal (format 4) in hex, and its reports are marshal records:
json's import alone would cost more than the rest of its start-up.

It unpacks the workspace into /work, forks the program with its rlimits and
environment, and waits for it while it enforces the wall-clock limit (which
counts the unpacking, and past which packing gets `pack_s` more) and the
memory limit of the whole run (the resident memory of every process in the
namespace, sampled every `_POLL_S`, unless the cap is past the host's memory:
a long-lived run then costs nothing while it waits). When the program ends it kills whatever
the program left (kill(-1) from PID 1 reaches every other process of the
namespace), reaps them, packs /work when the caller keeps the workspace, and
writes one JSON report to the status descriptor. When its launcher dies (the
lifeline descriptor, a pipe whose one write end the launcher holds, reads
EOF) it kills everything at once and exits: the sandbox never outlives it.

The program runs as the same uid, so this process protects itself: it is not
dumpable (no ptrace, no /proc/1/mem, no /proc/1/fd), and as PID 1 of the
namespace it receives no signal it has no handler for (SIGKILL included) from
inside; it installs none.
"""

# `signal` itself imports enum, a third of this process's start-up; its C core has all we use.
import _signal as signal
import ctypes
import marshal
import os
import resource
import select
import sys
import time

import workspace

_PR_SET_DUMPABLE = 4
_POLL_S = 0.02  # memory sampling period; a faster leak is still cut by RLIMIT_AS per process
_WORK = "/work"


def _report(fd, **fields):
  os.write(fd, marshal.dumps(fields, 4))


def _read_all(fd):
  return os.pread(fd, os.fstat(fd).st_size, 0)


def _resident_bytes(page):
  """Sums the resident memory of every process in the namespace but this one."""
  total = 0
  for name in os.listdir("/proc"):
    if name.isdigit() and name != "1":
      try:
        with open(f"/proc/{name}/statm", "rb") as f:
          total += int(f.read().split()[1]) * page
      except (OSError, IndexError, ValueError):
        pass  # it exited while we looked
  return total


def _kill_all():
  try:
    os.kill(-1, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _reap_all(program, status):
  """Reaps every child; returns the program's wait status (`status` when reaped already)."""
  while True:
    try:
      pid, st = os.waitpid(-1, 0)
    except ChildProcessError:
      return status
    if pid == program:
      status = st


def _exec_program(cfg, status_fd):
  """The forked child: limits, signals, working directory, then exec; never returns."""
  try:
    os.setsid()
    lim = cfg["limits"]
    for which, value in ((resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, lim["file_bytes"]), (resource.RLIMIT_NPROC, lim["processes"]),
                         (resource.RLIMIT_NOFILE, lim["open_files"]), (resource.RLIMIT_CORE, 0)):
      # SIGXCPU at the soft CPU limit, SIGKILL a second later.
      resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
      signal.signal(sig, signal.SIG_DFL)  # Python changed them; the program gets the defaults
    os.chdir(_WORK)
    argv = cfg["argv"]
    os.execvpe(argv[0], argv, cfg["env"])
  except Exception as e:  # noqa: BLE001  (the program never ran: the report says why)
    _report(status_fd, exec_error=f"{cfg['argv'][0]}: {e}")
  os._exit(127)


def main(cfg):
  """Runs one program as configured and reports; returns the exit status of this process."""
  ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
  signal.signal(signal.SIGINT, signal.SIG_DFL)  # no handler: the program cannot interrupt us
  status_fd, in_fd, out_fd = cfg["status_fd"], cfg["workspace_in_fd"], cfg["workspace_out_fd"]
  lifeline = cfg["lifeline_fd"]
  for fd in (status_fd, in_fd, out_fd, lifeline):
    if fd is not None:
      os.set_inheritable(fd, False)
  lim = cfg["limits"]
  # What earlier runs left is the program's doing: unpacking and packing it are part of the run's time.
  deadline = time.monotonic() + lim["timeout_s"]
  try:
    os.chmod(_WORK, 0o700)
    workspace.unpack(_read_all(in_fd), _WORK, deadline)
  except workspace.TooSlow:
    _report(status_fd, started=True, exit=-signal.SIGKILL, killed="timeout")  # its time ran out before it began
    return 0
  except Exception as e:  # noqa: BLE001  (the program never ran: not its fault)
    _report(status_fd, setup_error=f"unpacking the workspace: {e}", setup_errno=getattr(e, "errno", None))
    return 0
  os.close(in_fd)
  page = os.sysconf("SC_PAGE_SIZE")
  started = time.monotonic()
  program = os.fork()
  if program == 0:
    _exec_program(cfg, status_fd)
  _report(status_fd, started=True)  # from here on, a missing final report is the program's doing
  for fd in cfg["pass_fds"]:
    os.close(fd)  # the program's alone: its peer sees EOF when the program ends
  pidfd = os.pidfd_open(program)
  killed, peak = "", 0
  sampled = lim["run_memory_bytes"] is not None  # None: a cap past the host's memory, which no run can reach
  while True:
    left = deadline - time.monotonic()
    if left <= 0 and not killed:
      killed = "timeout"
      _kill_all()
    wait = None if killed else max(0.0, min(left, _POLL_S) if sampled else left)
    ready = select.select([pidfd, lifeline], [], [], wait)[0]
    if lifeline in ready:  # EOF: the launcher is gone, and with it whoever wanted this run's result
      _kill_all()
      return 0  # PID 1's exit takes down whatever is left in its namespace
    if ready:
      break
    if not sampled:
      continue
    resident = _resident_bytes(page)
    peak = max(peak, resident)
    if resident > lim["run_memory_bytes"] and not killed:
      killed = "memory"
      _kill_all()
  _, status, _ = os.wait4(program, 0)
  wall = time.monotonic() - started
  _kill_all()  # what the program left behind
  _reap_all(program, status)
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  report = {"exit": os.waitstatus_to_exitcode(status), "killed": killed, "wall_s": wall,
            "cpu_user_s": usage.ru_utime, "cpu_system_s": usage.ru_stime, "max_rss_bytes": usage.ru_maxrss * 1024,
            "peak_resident_bytes": peak}
  if out_fd is not None:
    try:
      os.chmod(_WORK, 0o700)
      blob = workspace.pack(_WORK, cfg["workspace_bytes"], deadline + lim["pack_s"])
      view = memoryview(blob)
      while view:
        view = view[os.write(out_fd, view):]
      report["packed"] = len(blob)
    except workspace.TooLarge as e:
      report["pack_error"] = str(e)
  _report(status_fd, **report)
  return 0


if __name__ == "__main__":
  sys.exit(main(marshal.loads(bytes.fromhex(sys.argv[1]))))
