"""ptx.sandbox.inside.workspace: round trips, hostile blobs, links never followed, and trees no recursion could remove.

The format holds a sandbox workspace between runs, and PID 1 inside the
sandbox packs what the program left: a tree the program built to hurt
whoever walks it. Hostile blobs are made from valid ones (paths swapped for
ones of the same length, bytes cut or flipped), so these tests hold whatever
the encoding of a header.
"""

import os
import random
import stat
import time

import pytest

from ptx.sandbox import run as sandbox
from ptx.sandbox.inside import workspace as wf

_BIG = 1 << 30  # a byte budget no test tree comes near


def _tree(root):
  """Writes a tree of every kind of entry the format keeps, with odd names and modes."""
  (root / "sub" / "deeper").mkdir(parents=True)
  (root / "empty.txt").write_bytes(b"")
  (root / "binary.bin").write_bytes(bytes(range(256)) * 3)
  (root / "sub" / "name with spaces\nand a newline").write_text("odd name")
  (root / "sub" / "deeper" / "ünïcode.py").write_text("print('hi')\n")
  os.mkdir(os.fsencode(root / "sub") + b"/not-utf8-\xff")
  (root / "run.sh").write_text("#!/bin/sh\n")
  (root / "run.sh").chmod(0o755)
  (root / "locked.txt").write_text("no one may read me")
  (root / "locked.txt").chmod(0)
  (root / "link-out").symlink_to("/etc/passwd")
  (root / "sub" / "link-up").symlink_to("..")
  (root / "sub" / "deeper").chmod(0o500)


def _listing(root):
  """Every entry under `root`: relative path -> (kind, mode, content or link target)."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
      path = os.path.join(dirpath, name)
      st = os.lstat(path)
      mode = stat.S_IMODE(st.st_mode)
      if stat.S_ISLNK(st.st_mode):
        content = os.readlink(path)
      elif stat.S_ISREG(st.st_mode):
        os.chmod(path, mode | 0o400)
        with open(path, "rb") as f:
          content = f.read()
        os.chmod(path, mode)
      else:
        content = None
      out[os.path.relpath(path, root)] = (stat.S_IFMT(st.st_mode), mode, content)
  return out


def test_pack_and_unpack_round_trip(tmp_path):
  src, dst = tmp_path / "src", tmp_path / "dst"
  src.mkdir()
  dst.mkdir()
  _tree(src)
  expected = _listing(src)  # pack gives its owner back the rights reading needs, and records the modes it found
  blob = wf.pack(str(src), _BIG)
  wf.unpack(blob, str(dst))
  assert _listing(dst) == expected
  assert wf.pack(str(dst), _BIG) == blob  # the same tree packs to the same bytes
  entries = {path: (kind, payload) for kind, path, _, payload in wf.decode(blob)}
  assert entries["link-out"] == ("l", "/etc/passwd") and entries["sub/link-up"] == ("l", "..")
  assert entries["locked.txt"] == ("f", b"no one may read me")
  assert wf.decode(wf.encode(wf.decode(blob))) == wf.decode(blob)


def test_pack_keeps_links_as_links_and_skips_what_is_not_a_file(tmp_path):
  """A link to a host file or directory is packed as its target's name, never its content; fifos are skipped."""
  secret = tmp_path / "secret"
  secret.mkdir()
  (secret / "key").write_text("host secret")
  root = tmp_path / "ws"
  root.mkdir()
  (root / "to-file").symlink_to(secret / "key")
  (root / "to-dir").symlink_to(secret)
  os.mkfifo(root / "fifo")  # reading it would block the packer forever
  blob = wf.pack(str(root), _BIG)
  assert b"host secret" not in blob
  assert wf.decode(blob) == [("l", "to-dir", 0o777, str(secret)), ("l", "to-file", 0o777, str(secret / "key"))]


def test_workspace_write_through_a_planted_link_is_refused(tmp_path):
  """A run left links to a host directory and file: writing between runs must not follow them."""
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "passwd").write_text("host")
  root = tmp_path / "ws"
  root.mkdir()
  (root / "dir").symlink_to(outside)
  (root / "file").symlink_to(outside / "passwd")
  ws = sandbox.Workspace()
  ws.snapshot = wf.pack(str(root), _BIG)
  for name in ("dir/passwd", "dir/new", "file"):
    with pytest.raises(ValueError, match="inside the workspace"):
      ws.write({name: "pwned"})
  assert ws.files() == {}
  assert [p.name for p in outside.iterdir()] == ["passwd"] and (outside / "passwd").read_text() == "host"


def test_merge_adds_replaces_and_makes_parents():
  blob = wf.merge(b"", {"a/b/c.txt": b"1", "top": b"t"})
  blob = wf.merge(blob, {"a/b/c.txt": b"2", "a/d.txt": b"3"})
  entries = wf.decode(blob)
  assert [(k, p) for k, p, _, _ in entries if k == "d"] == [("d", "a"), ("d", "a/b")]
  assert {p: d for k, p, _, d in entries if k == "f"} == {"a/b/c.txt": b"2", "a/d.txt": b"3", "top": b"t"}
  for name in ("top/x", "a", "a/b", "../x", "/abs", "a//b", "./a", "a/./b", "x\0y", ""):
    with pytest.raises(wf.BadEntry):
      wf.merge(blob, {name: b"x"})


def _swap_path(entries, clean, hostile):
  """A blob of `entries` whose path `clean` is replaced, byte for byte, by `hostile` (the same length)."""
  assert len(clean) == len(hostile)
  blob = wf.encode(entries)
  assert blob.count(clean.encode()) == 1
  return blob.replace(clean.encode(), hostile.encode())


@pytest.mark.parametrize("hostile", ["/etc/passwd", "../../evil", "a/../../xx", "a//bcdefgh", "./abcdefgh",
                                     "abc\0defghi"])
def test_hostile_paths_are_refused_before_anything_is_written(hostile, tmp_path):
  clean = "x" * len(hostile)
  blob = _swap_path([("f", "first", 0o644, b"1"), ("f", clean, 0o644, b"evil")], clean, hostile)
  with pytest.raises(wf.BadEntry):
    wf.decode(blob)
  root = tmp_path / "root"
  root.mkdir()
  with pytest.raises(wf.BadEntry):
    wf.unpack(blob, str(root))
  assert list(tmp_path.iterdir()) == [root] and list(root.iterdir()) == []


def test_an_unknown_kind_and_cut_blobs_are_bad_entries():
  with pytest.raises(wf.BadEntry):
    wf.decode(wf.encode([("x", "a", 0o644, b"")]))
  blob = wf.encode([("d", "a", 0o755, 0), ("f", "a/b", 0o644, b"content"), ("l", "c", 0o777, "a/b")])
  assert len(wf.decode(blob)) == 3
  for end in range(1, len(blob)):  # every cut: inside a header, a path, a file's bytes (a size past the end)
    try:
      entries = wf.decode(blob[:end])
    except wf.BadEntry:
      continue
    assert len(entries) < 3, f"a blob cut at {end} decoded whole"


def test_random_and_mutated_blobs_decode_or_raise_bad_entry():
  """Whatever the bytes, decode returns clean entries or raises BadEntry: no other exception, no hang."""
  rng = random.Random(0)
  valid = wf.encode([("d", "a", 0o755, 0), ("f", "a/b", 0o644, b"content" * 10), ("l", "c", 0o777, "a/b")])
  blobs = [b"garbage", b"\0" * 64, b"\xff" * 64, b"\n" * 8, b"[]\n", b'["f", "a", 420, 99999999999]\n']
  blobs += [rng.randbytes(rng.randrange(1, 200)) for _ in range(300)]
  for _ in range(700):
    blob = bytearray(valid)
    for _ in range(rng.randrange(1, 4)):
      blob[rng.randrange(len(blob))] = rng.randrange(256)
    blobs.append(bytes(blob))
  for blob in blobs:
    try:
      entries = wf.decode(blob)
    except wf.BadEntry:
      continue
    for kind, path, _, _ in entries:
      assert kind in ("d", "f", "l") and wf.check_path(path) == path


@pytest.mark.parametrize("order", ["link first", "file first"])
def test_unpack_never_writes_through_a_link(order, tmp_path):
  """A crafted blob whose file sits under (or on) a link to a host directory (or file)."""
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "victim").write_text("host")
  link = [("l", "a", 0o777, str(outside)), ("l", "v", 0o777, str(outside / "victim"))]
  files = [("f", "a/victim", 0o644, b"pwned"), ("f", "a/new", 0o644, b"pwned"), ("f", "v", 0o644, b"pwned")]
  root = tmp_path / "root"
  root.mkdir()
  with pytest.raises((wf.BadEntry, OSError)):
    wf.unpack(wf.encode(link + files if order == "link first" else files + link), str(root))
  assert sorted(p.name for p in outside.iterdir()) == ["victim"] and (outside / "victim").read_text() == "host"


def test_pack_refuses_past_its_limits(tmp_path):
  deep = tmp_path / "deep"
  fd = os.open(tmp_path, os.O_RDONLY)
  os.mkdir("deep", dir_fd=fd)
  for _ in range(3000):  # past PATH_MAX: only descriptors reach the bottom
    child = os.open("deep" if _ == 0 else "d", os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = child
    os.mkdir("d", dir_fd=fd)
  os.close(fd)
  with pytest.raises(wf.TooLarge, match="deeper"):
    wf.pack(str(deep), _BIG)
  wide = tmp_path / "wide"
  wide.mkdir()
  for i in range(wf.MAX_ENTRIES + 1):
    (wide / str(i)).touch()
  with pytest.raises(wf.TooLarge, match="entries"):
    wf.pack(str(wide), _BIG)
  big = tmp_path / "big"
  big.mkdir()
  (big / "f").write_bytes(b"x" * 4096)
  with pytest.raises(wf.TooLarge, match="bytes"):
    wf.pack(str(big), 4000)
  wf.remove(str(deep))


def test_pack_counts_names_and_headers_in_its_byte_budget(tmp_path):
  """Directories and empty files take no page of a tmpfs; their names are still bytes the snapshot holds."""
  root = tmp_path / "names"
  deep = root / ("d" * 250) / ("e" * 250)
  deep.mkdir(parents=True)
  for i in range(200):
    (deep / f"{i:0>250}").touch()
  blob = wf.pack(str(root), _BIG)
  assert len(blob) > 200 * 750  # every entry holds its whole path
  assert wf.pack(str(root), len(blob)) == blob
  with pytest.raises(wf.TooLarge, match="bytes"):
    wf.pack(str(root), len(blob) - 1)


def test_pack_and_unpack_stop_at_their_deadline(tmp_path):
  src, dst = tmp_path / "src", tmp_path / "dst"
  (src / "sub").mkdir(parents=True)
  dst.mkdir()
  (src / "sub" / "f").write_text("x")
  with pytest.raises(wf.TooSlow):
    wf.pack(str(src), _BIG, deadline=time.monotonic() - 1)
  blob = wf.pack(str(src), _BIG, deadline=time.monotonic() + 600)
  assert isinstance(wf.TooSlow("x"), wf.TooLarge)  # a caller keeps nothing either way
  with pytest.raises(wf.TooSlow):
    wf.unpack(blob, str(dst), deadline=time.monotonic() - 1)
  wf.remove(str(dst))
  dst.mkdir()
  wf.unpack(blob, str(dst), deadline=time.monotonic() + 600)
  assert (dst / "sub" / "f").read_text() == "x"


def test_remove_a_3000_deep_chain_of_locked_directories(tmp_path):
  """Every directory mode 000 with a mode-000 file in it, 3000 deep, and a link out: all gone, the target kept."""
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep").write_text("keep")
  root = tmp_path / "tree"
  root.mkdir()
  (root / "link").symlink_to(outside)
  fd = os.open(root, os.O_RDONLY)
  for _ in range(3000):
    os.mkdir("d", dir_fd=fd)
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0, dir_fd=fd))
    child = os.open("d", os.O_RDONLY, dir_fd=fd)
    os.fchmod(fd, 0)  # locked once we hold its child: not even its owner may look in
    os.close(fd)
    fd = child
  os.fchmod(fd, 0)
  os.close(fd)
  wf.remove(str(root))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["outside"]  # nothing left, not even a moved directory
  assert (outside / "keep").read_text() == "keep"
