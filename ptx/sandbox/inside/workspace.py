"""A sandbox workspace as bytes: pack a directory tree, unpack it into an empty one.

A workspace lives between runs as one byte string, not as a directory on the
host: each run unpacks it into a fresh, size-capped directory of its own and,
when the caller keeps the workspace, packs it again afterwards. The host's
disk never holds what a program wrote, so nothing a program leaves (deep
trees, odd permissions, millions of files) can outlive the run.

The format is a sequence of entries, each a fixed header (`_HEADER`: kind,
mode, payload length, path length) followed by the path and the payload:
a file's bytes, a link's target, nothing for a directory; kind is "d"
(directory), "f" (file) or "l" (symlink). A binary header rather than JSON
because PID 1 inside the sandbox packs and unpacks every run, and importing
json would cost more than the rest of its start-up. Paths are relative,
"/"-separated, without "." or ".." parts, parents before children. Packing
never follows symlinks, stops at `MAX_ENTRIES` entries, `MAX_DEPTH` levels and
a byte budget that counts every byte the blob stores (names and headers
included, so empty files under long names cost what they weigh),
and raises `TooLarge` past them; packing and unpacking also stop at a
deadline when given one (`TooSlow`), so a tree cannot stretch a run's time.

Standard library only: `init.py` runs it inside the sandbox, where
nothing of the project is importable, by prepending this file's source.
"""

import os
import stat
import struct
import time

MAX_ENTRIES = 10_000  # files, directories and links a workspace may hold
MAX_DEPTH = 64  # directory levels below the workspace root
_CHUNK = 1 << 20
_HEADER = struct.Struct("<cIQI")  # kind, mode, payload bytes, path bytes


class TooLarge(Exception):
  """The tree passes a limit of the format; the message says which."""


class TooSlow(TooLarge):
  """Packing or unpacking passed its deadline."""


def _on_time(deadline):
  if deadline is not None and time.monotonic() > deadline:
    raise TooSlow("packing or unpacking the workspace passed the run's time limit")


class BadEntry(ValueError):
  """An entry that cannot be part of a workspace (its path or kind is invalid)."""


def check_path(path):
  """Returns `path` when it is a clean relative path, else raises BadEntry.

  Args:
    path: a "/"-separated relative path.

  Returns:
    The path.
  """
  parts = path.split("/")
  if not path or path.startswith("/") or "\x00" in path or any(p in ("", ".", "..") for p in parts):
    raise BadEntry(f"workspace path must be relative without '.', '..' or empty parts, got {path!r}")
  if len(parts) > MAX_DEPTH:
    raise BadEntry(f"workspace path is deeper than {MAX_DEPTH} levels: {path[:80]!r}...")
  return path


def _entry(kind, path, mode, payload=b""):
  name = os.fsencode(path)
  return _HEADER.pack(kind.encode(), mode, len(payload), len(name)) + name + payload


def encode(entries):
  """Returns the bytes of `entries`: (kind, path, mode, file data, link target or 0) tuples."""
  out = bytearray()
  for kind, path, mode, payload in entries:
    out += _entry(kind, path, mode, payload if kind == "f" else os.fsencode(payload) if kind == "l" else b"")
  return bytes(out)


def decode(blob):
  """Returns the entries of `blob` as (kind, path, mode, file data, link target or 0) tuples; raises BadEntry."""
  entries, pos = [], 0
  while pos < len(blob):
    if pos + _HEADER.size > len(blob):
      raise BadEntry(f"workspace blob: the header at byte {pos} is cut short")
    kind, mode, size, name_len = _HEADER.unpack_from(blob, pos)
    pos += _HEADER.size
    if pos + name_len + size > len(blob):
      raise BadEntry(f"workspace blob: the entry at byte {pos} claims {name_len + size} bytes past the end")
    path = check_path(os.fsdecode(bytes(blob[pos:pos + name_len])))
    payload = bytes(blob[pos + name_len:pos + name_len + size])
    pos += name_len + size
    if kind == b"f":
      entries.append(("f", path, mode, payload))
    elif kind == b"l":
      entries.append(("l", path, mode, os.fsdecode(payload)))
    elif kind == b"d":
      entries.append(("d", path, mode, 0))
    else:
      raise BadEntry(f"workspace blob: unknown kind {kind!r} for {path!r}")
  return entries


def merge(blob, files):
  """Returns `blob` with `files` (path -> bytes) added or replaced, parents made; raises BadEntry.

  A name that would pass through a symlink or replace a directory is refused,
  so writing between runs cannot reach outside the workspace.
  """
  entries = {e[1]: e for e in decode(blob)}
  for path, data in files.items():
    check_path(path)
    parts = path.split("/")
    for i in range(1, len(parts)):
      parent = "/".join(parts[:i])
      kind = entries.get(parent, ("d",))[0]
      if kind != "d":
        raise BadEntry(f"workspace file {path!r} would pass through {parent!r}, which is not a directory")
      entries.setdefault(parent, ("d", parent, 0o755, 0))
    if entries.get(path, ("f",))[0] != "f":
      raise BadEntry(f"workspace file {path!r} would replace a directory or a link")
    entries[path] = ("f", path, 0o644, data)
  return encode(sorted(entries.values(), key=lambda e: e[1].count("/")))


def pack(root, max_bytes, deadline=None):
  """Packs the tree under directory `root` without following links.

  Args:
    root: the directory.
    max_bytes: the most the tree may take: each entry's header and path, plus
      each file and link in whole pages as a tmpfs stores them (a sparse file
      costs its size). The bytes returned are never longer, and they always
      unpack into a tmpfs of that size.
    deadline: a `time.monotonic()` time to stop at, or None.

  Returns:
    The bytes.

  Raises:
    TooLarge: past MAX_ENTRIES, MAX_DEPTH or `max_bytes`; TooSlow past `deadline`.
  """
  out = bytearray()
  count = used = 0
  page = os.sysconf("SC_PAGE_SIZE")
  # Breadth first with one open directory at a time: paths are re-opened
  # relative to the root fd, so depth costs neither recursion nor descriptors.
  root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
  try:
    pending = [""]
    while pending:
      rel = pending.pop(0)
      fd = root_fd if not rel else _open_dir(root_fd, rel)
      try:
        names = sorted(os.listdir(fd))
        for name in names:
          count += 1
          if count > MAX_ENTRIES:
            raise TooLarge(f"the workspace holds more than {MAX_ENTRIES} entries")
          _on_time(deadline)
          path = f"{rel}/{name}" if rel else name
          head = _HEADER.size + len(os.fsencode(path))  # what the entry itself takes in the blob
          st = os.stat(name, dir_fd=fd, follow_symlinks=False)
          mode = stat.S_IMODE(st.st_mode)
          # A program may have taken its own permissions away (chmod 000): the
          # packer is its owner and gives back what reading needs.
          need = 0o700 if stat.S_ISDIR(st.st_mode) else 0o400 if stat.S_ISREG(st.st_mode) else 0
          if mode & need != need:
            os.chmod(name, mode | need, dir_fd=fd)
          if stat.S_ISDIR(st.st_mode):
            if path.count("/") + 1 >= MAX_DEPTH:
              raise TooLarge(f"the workspace is deeper than {MAX_DEPTH} levels")
            used += head
            if used > max_bytes:
              raise TooLarge(f"the workspace takes more than {max_bytes} bytes")
            out += _entry("d", path, mode)
            pending.append(path)
          elif stat.S_ISLNK(st.st_mode) or stat.S_ISREG(st.st_mode):
            pages = -(-st.st_size // page)  # a link's target may take a page of its own
            used += head + (max(pages, 1) if stat.S_ISLNK(st.st_mode) else pages) * page
            if used > max_bytes:
              raise TooLarge(f"the workspace takes more than {max_bytes} bytes")
            if stat.S_ISLNK(st.st_mode):
              out += _entry("l", path, mode, os.fsencode(os.readlink(name, dir_fd=fd)))
            else:
              out += _entry("f", path, mode, _read_file(fd, name, st.st_size))
          # Sockets, fifos and devices are not part of a workspace.
      finally:
        if fd != root_fd:
          os.close(fd)
  finally:
    os.close(root_fd)
  return bytes(out)


def unpack(blob, root, deadline=None):
  """Writes the entries of `blob` into the empty directory `root`; raises BadEntry, or TooSlow past `deadline`.

  Files are created exclusively and never through a link, links come last,
  and directory modes are applied deepest first after their contents.
  `deadline` is a `time.monotonic()` time, or None.
  """
  entries = decode(blob)
  root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
  try:
    links = [e for e in entries if e[0] == "l"]
    dirs = [e for e in entries if e[0] == "d"]
    for kind, path, mode, payload in entries:
      _on_time(deadline)
      parent, _, name = path.rpartition("/")
      fd = _open_dir(root_fd, parent) if parent else root_fd
      try:
        if kind == "d":
          os.mkdir(name, 0o700, dir_fd=fd)
        elif kind == "f":
          out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
          try:
            view = memoryview(payload)
            while view:
              view = view[os.write(out, view[:_CHUNK]):]
            os.fchmod(out, mode & 0o777)
          finally:
            os.close(out)
      finally:
        if fd != root_fd:
          os.close(fd)
    for _, path, _, target in links:
      _on_time(deadline)
      parent, _, name = path.rpartition("/")
      fd = _open_dir(root_fd, parent) if parent else root_fd
      try:
        os.symlink(target, name, dir_fd=fd)
      finally:
        if fd != root_fd:
          os.close(fd)
    for _, path, mode, _ in sorted(dirs, key=lambda e: -e[1].count("/")):
      fd = _open_dir(root_fd, path)
      try:
        os.fchmod(fd, mode & 0o777)
      finally:
        os.close(fd)
  finally:
    os.close(root_fd)


def _open_dir(root_fd, rel):
  """Opens directory `rel` under `root_fd`, refusing a link at any level."""
  fd = root_fd
  try:
    for part in rel.split("/"):
      nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
      if fd != root_fd:
        os.close(fd)
      fd = nxt
  except OSError:
    if fd != root_fd:
      os.close(fd)
    raise
  return fd


def _read_file(dir_fd, name, size):
  fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
  try:
    data = bytearray()
    while len(data) < size:
      chunk = os.read(fd, min(_CHUNK, size - len(data)))
      if not chunk:
        break
      data += chunk
    # A file that shrank while packing keeps the size its header promised.
    return bytes(data.ljust(size, b"\0"))
  finally:
    os.close(fd)


def remove(root):
  """Deletes the tree under `root` and `root` itself, however deep or locked its directories are.

  Each subdirectory is first moved up to the top level, so neither recursion
  nor open descriptors grow with depth, and is given back the permissions
  deleting needs (its owner, or root, may always do that).
  """
  parent, _, base = os.path.abspath(root).rpartition("/")
  top = os.open(parent or "/", os.O_RDONLY | os.O_DIRECTORY)
  try:
    pending, moved = [base], 0
    while pending:
      name = pending.pop()
      os.chmod(name, 0o700, dir_fd=top)
      fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
      try:
        for entry in os.listdir(fd):
          if stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
            moved += 1
            flat = f"{base}.rm{moved}"
            os.chmod(entry, 0o700, dir_fd=fd)  # moving a directory rewrites its ".."
            os.rename(entry, flat, src_dir_fd=fd, dst_dir_fd=top)
            pending.append(flat)
          else:
            os.unlink(entry, dir_fd=fd)
      finally:
        os.close(fd)
      os.rmdir(name, dir_fd=top)
  finally:
    os.close(top)
