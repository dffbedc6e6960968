"""Where run files, data and models live: a local path or object storage (`gs://`), as one path type.

`path(p)` is the one conversion from what a user writes (a string, a
`pathlib.Path`) to `etils.epath.Path`, the type Orbax and grain take too.
Every module that reads or writes run files (data, checkpoints, metrics,
exports, plots, model directories) converts with it, so `--out gs://b/run`
stays `gs://b/run` (argparse's `type=pathlib.Path` folds it into the local
directory `gs:/b/run`) and a path ptx cannot handle is refused by name.
Local paths are plain files (epath calls `open`, `os` and `shutil`); `gs://`
paths go through epath's GCS backend (gcsfs, the `gcs` extra; tf.io.gfile
where TensorFlow is installed) and Orbax's arrays through tensorstore's
`gcs` driver. Both find credentials as Application Default Credentials.

Object storage has no append, no rename over an object and no links; a
single object write (an upload) is atomic: readers see the old object or the
whole new one. So `write_atomic` is a temporary file and `os.replace`
locally and one upload on object storage; `local_file` and `local_copy`
give code that needs a file name (safetensors, tokenizers) a local file
that is uploaded whole, or a local copy that was downloaded whole.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import tempfile
from typing import Iterator

from etils import epath

Path = epath.Path
# URL schemes ptx reads and writes: Orbax checkpoints natively (tensorstore's driver) only on GCS.
SCHEMES = ("gs",)
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/+)")


class PathError(ValueError):
  """A path ptx cannot read or write: an unsupported scheme, a URL that lost a slash, a missing backend."""


def path(p: str | os.PathLike) -> epath.Path:
  """`p` as the library's path type: a local path, or a `gs://` URL kept as a URL.

  Args:
    p: a string or path-like (`pathlib.Path`, `epath.Path`).

  Returns:
    The `epath.Path` of `p`.

  Raises:
    PathError: `p` has a scheme other than gs://, looks like a gs:// URL
      folded by `pathlib.Path` (`gs:/b/x`), or is gs:// without the `gcs` extra.
  """
  text = os.fspath(p)
  if not isinstance(text, str):
    raise PathError(f"{text!r}: a path must be text, not bytes")
  url = _URL.match(text)
  if url is not None:
    scheme, slashes = url.groups()
    if scheme.lower() not in SCHEMES:
      raise PathError(f"{text}: {scheme}:// is not supported; ptx reads and writes local paths and "
                      f"{', '.join(s + '://' for s in SCHEMES)}")
    if slashes != "//":
      raise PathError(f"{text}: a {scheme}:// URL with {len(slashes)} slash(es) after '{scheme}:' (pathlib.Path "
                      f"folds '//' into '/'); write {scheme}://BUCKET/PATH")
    try:
      import gcsfs  # noqa: F401  (the gcs extra: epath's gs:// backend; imported once a gs:// path is used)
    except ImportError as e:
      raise PathError(f"{text}: gs:// paths need the gcs extra: pip install 'ptx[gcs]' ({e})") from None
  return epath.Path(text)


def argument(text: str) -> epath.Path:
  """`path` as an argparse `type=`: a refusal becomes the message argparse prints, unchanged."""
  try:
    return path(text)
  except PathError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def is_local(p: epath.Path) -> bool:
  """Whether `p` is on the local file system (not object storage)."""
  return _URL.match(os.fspath(p)) is None


def remove(p: epath.Path) -> None:
  """Deletes the file or directory tree `p` (a local symlink as a link, never what it points to); absent is fine."""
  if is_local(p):
    if os.path.isdir(p) and not os.path.islink(p):
      shutil.rmtree(p)
    elif os.path.lexists(p):
      os.unlink(p)
  elif p.is_dir():
    p.rmtree()
  elif p.exists():
    p.unlink()


def write_atomic(p: epath.Path, data: str | bytes) -> None:
  """Replaces the file `p` by `data` at once: readers see the old contents or the new, never a part."""
  if not is_local(p):
    p.write_bytes(data.encode() if isinstance(data, str) else data)  # one upload: atomic on object storage
    return
  temporary = p.with_name(p.name + ".tmp")
  temporary.write_bytes(data.encode() if isinstance(data, str) else data)
  os.replace(temporary, p)


@contextlib.contextmanager
def local_file(p: epath.Path) -> Iterator[str]:
  """A local file name to write `p` through: `p` itself locally; on object storage, uploaded whole on success."""
  if is_local(p):
    yield os.fspath(p)
    return
  with tempfile.TemporaryDirectory(prefix="ptx-upload-") as directory:
    staged = os.path.join(directory, p.name)
    yield staged
    epath.Path(staged).copy(p, overwrite=True)


@contextlib.contextmanager
def local_copy(directory: epath.Path) -> Iterator[epath.Path]:
  """`directory` with local files: itself locally; from object storage, its files downloaded, deleted on exit.

  Only the directory's files are copied (not subdirectories): an HF model
  directory holds everything at its top level.
  """
  if is_local(directory):
    yield directory
    return
  with tempfile.TemporaryDirectory(prefix="ptx-download-") as staged:
    for file in directory.iterdir():
      if not file.is_dir():
        file.copy(epath.Path(staged) / file.name)
    yield epath.Path(staged)
