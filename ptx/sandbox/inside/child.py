"""The rlimits backend's child side: confine this process, then exec the program.

Run as `python -I -S child.py CONFIG` (marshal in hex), never imported: it uses the
standard library only. `ptx.sandbox.run` starts it in a new session, inside the
run's directory, with a scrubbed environment. Before the exec, in this order,
it cuts the network (a new network namespace; as non-root, inside a new user
namespace), gives the run a private filesystem root (as root), sets the
rlimits, drops to the run's uid when it has one, and restores the signal
dispositions that Python changed. Every step happens before
the exec so that the program never runs unconfined.

It reports to the status file (a marshal record, as `inside/init.py` does)
what it achieved; the descriptor is close-on-exec, so the program cannot
write to it. An exec failure is reported there too, with exit status 127.

With `--reap UID` it becomes UID and sends SIGKILL to every process that UID
owns: kill(-1) by an unprivileged user reaches exactly that user's processes,
including strays that left the process group.
"""

import ctypes
import marshal
import os
import resource
import signal
import sys
# os.execvpe imports it lazily, and after the uid drop the standard library may
# be unreadable (a Python under /root): import it while still privileged.
import warnings  # noqa: F401

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
# What a program may see of the host's filesystem, besides /dev and /proc.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_NEW_ROOT = "/tmp"  # where the new root's tmpfs is mounted before chroot
_TMPFS = "size=16m,mode={mode}"  # the root (and /tmp in it), and /dev/shm


_libc = ctypes.CDLL(None, use_errno=True)


def _unshare(flags):
  """Returns "" on success, else the error text."""
  if _libc.unshare(flags) != 0:
    return os.strerror(ctypes.get_errno())
  return ""


def _mount(source, target, fstype, flags, data):
  if _libc.mount(source.encode(), target.encode(), fstype and fstype.encode(), flags,
                 data and data.encode()) != 0:
    raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")


def _private_root():
  """Confines the run's view of the filesystem; returns "" or why it could not.

  In a new mount namespace, a fresh tmpfs becomes the root: the system
  directories programs need (`_SYSTEM_DIRS`) bound in from the host, /dev and
  /proc bound in, and empty /tmp, /var/tmp and /dev/shm of its own. Nothing else
  of the host (home directories, datasets, the repository) is visible. The
  workspace is bound back at its own path from a descriptor, since the tmpfs
  covers /tmp, where it usually lives. Everything vanishes with the run.
  """
  workspace = os.getcwd()
  error = _unshare(_CLONE_NEWNS)
  if error:
    return error
  # Opened inside the new namespace: a bind mount's source must belong to it.
  keep = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
  try:
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE, None)  # keep our mounts from the host
    _mount("tmpfs", _NEW_ROOT, "tmpfs", _MS_NOSUID | _MS_NODEV, _TMPFS.format(mode="0755"))
    for path in _SYSTEM_DIRS + ("/dev", "/proc"):
      inside = _NEW_ROOT + path
      if os.path.islink(path):
        os.symlink(os.readlink(path), inside)  # merged /usr: /bin -> usr/bin
      elif os.path.isdir(path):
        os.makedirs(inside)
        _mount(path, inside, None, _MS_BIND | _MS_REC, None)
    for path in ("/tmp", "/var/tmp"):
      os.makedirs(_NEW_ROOT + path)
      os.chmod(_NEW_ROOT + path, 0o1777)
    # The host's /dev/shm came in with /dev: cover it.
    _mount("tmpfs", _NEW_ROOT + "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, _TMPFS.format(mode="1777"))
    os.makedirs(_NEW_ROOT + workspace, exist_ok=True)
    _mount(f"/proc/self/fd/{keep}", _NEW_ROOT + workspace, None, _MS_BIND, None)
    os.chroot(_NEW_ROOT)
    os.chdir(workspace)
  except OSError as e:
    return str(e)
  finally:
    os.close(keep)
  return ""


def _cut_network():
  """Moves into a new, empty network namespace; returns "" or why it failed."""
  if os.geteuid() == 0:
    return _unshare(_CLONE_NEWNET)
  uid, gid = os.geteuid(), os.getegid()
  error = _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
  if error:
    return error
  # Map the caller to itself, so files it writes keep their owner outside.
  try:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
  except OSError as e:
    return f"user namespace map: {e.strerror}"
  return ""


def _own_process_count():
  """Counts the processes of this user (RLIMIT_NPROC counts per user)."""
  uid = os.getuid()
  count = 0
  for name in os.listdir("/proc"):
    try:
      count += name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid
    except OSError:
      pass
  return count


def _set_limits(cfg):
  """Applies the rlimits; soft == hard except CPU, whose soft limit signals."""
  processes = cfg["processes"]
  if cfg["uid"] is None:
    # Without a uid of its own the run shares the caller's process count.
    processes += _own_process_count()
  for which, value in (
      (resource.RLIMIT_CPU, cfg["cpu_s"]),
      (resource.RLIMIT_AS, cfg["memory_bytes"]),
      (resource.RLIMIT_FSIZE, cfg["file_bytes"]),
      (resource.RLIMIT_NPROC, processes),
      (resource.RLIMIT_NOFILE, cfg["open_files"]),
      (resource.RLIMIT_CORE, 0),
  ):
    # SIGXCPU at the soft limit, SIGKILL one second later.
    hard = value + 1 if which == resource.RLIMIT_CPU else value
    resource.setrlimit(which, (value, hard))


def _become(uid):
  """Drops every privilege: no groups, gid and uid both `uid`."""
  os.setgroups([])
  os.setgid(uid)
  os.setuid(uid)


def _launch(cfg):
  """Confines this process and execs the program; returns only on failure."""
  status = cfg["status_fd"]
  report = {"net_error": _cut_network() if cfg["cut_network"] else "not requested"}
  try:
    if cfg["uid"] is not None:
      report["root_error"] = _private_root()
    _set_limits(cfg)
    if cfg["uid"] is not None:
      _become(cfg["uid"])
    os.umask(0o077)
    # Python ignores these; an exec'd program must get the defaults back.
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
      signal.signal(sig, signal.SIG_DFL)
    os.write(status, marshal.dumps(report, 4))
    os.set_inheritable(status, False)
    argv = cfg["argv"]
    os.execvpe(argv[0], argv, os.environ)
  except Exception as e:  # noqa: BLE001  (any failure here is the sandbox's, not the program's)
    os.write(status, marshal.dumps({"exec_error": f"{cfg['argv'][0]}: {e}"}, 4))
  os._exit(127)


def _reap(uid):
  """Becomes `uid` and kills every process it owns."""
  _become(uid)
  try:
    os.kill(-1, signal.SIGKILL)
  except ProcessLookupError:
    pass


if __name__ == "__main__":
  if sys.argv[1] == "--reap":
    _reap(int(sys.argv[2]))
  else:
    _launch(marshal.loads(bytes.fromhex(sys.argv[1])))
