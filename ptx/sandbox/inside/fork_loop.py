"""Inside a long-lived sandbox: runs one trusted Python program once per request, each time in a fork.

Never imported by ptx; standard library only. `ptx.sandbox.fork_server` runs it as
`python3 -I -S fork_loop.py SOCKET_FD PROGRAM.py` in a sandbox whose
workspace holds the program and what it imports. It imports PROGRAM once
(as a module, not as __main__), so each request costs a fork instead of an
interpreter's start-up and the program's imports.

A request is one SOCK_SEQPACKET message on SOCKET_FD: a marshal dict (the
child's limits) carrying descriptors, in order: stdin, stdout, stderr, a
status pipe, then the program's own (pipes to another run). The child gets
the first three as 0, 1, 2 and the rest from 3 on, with their numbers as
its arguments (`sys.argv[1:]`); it closes everything else it inherited (the
socket, other requests' pipes), sets its rlimits, and calls PROGRAM.main().
When it ends, or this loop kills it at its deadline, one marshal record
goes to the status pipe: exit status, "killed", CPU seconds, peak memory.

The loop stops taking requests at EOF on the socket (the host retired it)
and exits once its last child has been reported.
"""

import _signal as signal
import marshal
import os
import resource
import select
import socket
import sys
import time

_MAX_FDS = 16  # descriptors one request may carry
_CLOSE_BELOW = 1 << 16  # above any descriptor the loop holds (its RLIMIT_NOFILE is lower)


def _child(program, cfg, fds):
  """In the fork: renumbers descriptors, drops the rest, sets limits, runs the program; never returns."""
  code = 1
  try:
    keep = [*fds[:3], *fds[4:]]  # the status pipe (the fourth) is the loop's, not the child's
    park = max(fds) + 1  # above every descriptor received, so parking clobbers none of them
    for i, fd in enumerate(keep):
      os.dup2(fd, park + i)
    for i in range(len(keep)):
      os.dup2(park + i, i)
    os.closerange(len(keep), _CLOSE_BELOW)
    lim = cfg["limits"]
    for which, value in ((resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, lim["file_bytes"]), (resource.RLIMIT_NPROC, lim["processes"]),
                         (resource.RLIMIT_NOFILE, lim["open_files"]), (resource.RLIMIT_CORE, 0)):
      resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    sys.argv = [program.__file__, *(str(fd) for fd in range(3, len(keep)))]
    program.main()
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # noqa: BLE001  (reported as the exit status, with the traceback on stderr)
    import traceback
    traceback.print_exc()
  finally:
    try:
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(code)


def _report(fd, **fields):
  try:
    os.write(fd, marshal.dumps(fields, 4))
  except OSError:
    pass  # the host gave up on this request
  os.close(fd)


def main():
  """Serves requests until the socket reaches EOF and every child has been reported."""
  sock = socket.socket(fileno=int(sys.argv[1]))
  sys.path.append(os.getcwd())  # -I leaves the workspace off sys.path; the program lives there
  program = __import__(sys.argv[2].removesuffix(".py"))
  children = {}  # pidfd -> [pid, status fd, deadline, started, killed]
  taking = True
  while taking or children:
    now = time.monotonic()
    for pidfd, child in children.items():
      if now >= child[2] and not child[4]:
        child[4] = "timeout"
        os.kill(child[0], signal.SIGKILL)
    waits = [c[2] - now for c in children.values() if not c[4]]
    ready = select.select(([sock] if taking else []) + list(children), [], [],
                          max(0.0, min(waits)) if waits else None)[0]
    for fd in ready:
      if fd is sock:
        try:
          message, fds, _, _ = socket.recv_fds(sock, 1 << 16, _MAX_FDS)
        except OSError:
          message, fds = b"", []
        if not message:
          for extra in fds:
            os.close(extra)
          taking = False
          continue
        cfg = marshal.loads(message)
        pid = os.fork()
        if pid == 0:
          sock.close()
          _child(program, cfg, fds)
        for i, extra in enumerate(fds):
          if i != 3:
            os.close(extra)  # the child's now: its peers see EOF when it ends
        started = time.monotonic()
        children[os.pidfd_open(pid)] = [pid, fds[3], started + cfg["timeout_s"], started, ""]
      else:
        pid, status_fd, _, started, killed = children.pop(fd)
        os.close(fd)
        _, status, usage = os.wait4(pid, 0)
        _report(status_fd, exit=os.waitstatus_to_exitcode(status), killed=killed, started=True,
                wall_s=time.monotonic() - started, cpu_user_s=usage.ru_utime, cpu_system_s=usage.ru_stime,
                max_rss_bytes=usage.ru_maxrss * 1024)


if __name__ == "__main__":
  main()
