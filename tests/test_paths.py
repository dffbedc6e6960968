"""ptx.paths: one path type, URLs kept as URLs, refusals by name, and the local side of its file operations.

The object-storage side runs against a GCS emulator in tests/train/test_object_storage.py.
"""

import argparse
import os
import pathlib
import re

import pytest

from ptx import paths


def test_a_gs_url_stays_a_url_where_pathlib_folds_it():
  assert str(pathlib.Path("gs://bucket/run")) == "gs:/bucket/run"  # what argparse's type=pathlib.Path made of --out
  p = paths.path("gs://bucket/run")
  assert str(p / "checkpoints") == "gs://bucket/run/checkpoints"
  assert not paths.is_local(p)
  assert paths.is_local(paths.path(pathlib.Path("out") / "run"))


@pytest.mark.parametrize("text, says", [
    ("gs:/bucket/run", "with 1 slash(es)"),
    ("s3://bucket/run", "s3:// is not supported"),
    ("file:///tmp/run", "file:// is not supported"),
])
def test_paths_ptx_cannot_handle_are_refused_by_name(text, says):
  with pytest.raises(paths.PathError, match="^" + re.escape(text) + ": ") as e:
    paths.path(text)
  assert says in str(e.value)
  with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):  # what `--out` reports, the message unchanged
    paths.argument(text)


def test_remove_deletes_a_tree_a_file_and_a_link_but_not_what_the_link_points_to(tmp_path):
  kept = tmp_path / "kept"
  (kept / "inner").mkdir(parents=True)
  (tmp_path / "tree" / "inner").mkdir(parents=True)
  (tmp_path / "tree" / "inner" / "f").write_text("x")
  (tmp_path / "file").write_text("x")
  (tmp_path / "link").symlink_to(kept, target_is_directory=True)
  for name in ("tree", "file", "link", "absent"):
    paths.remove(paths.path(tmp_path / name))
  assert sorted(os.listdir(tmp_path)) == ["kept"]
  assert (kept / "inner").is_dir()


def test_write_atomic_replaces_a_local_file_through_a_temporary(tmp_path):
  target = paths.path(tmp_path / "metrics.jsonl")
  paths.write_atomic(target, "a\n")
  paths.write_atomic(target, b"b\n")
  assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # the temporary was renamed over it
  assert (tmp_path / "metrics.jsonl").read_text() == "b\n"


def test_local_file_and_local_copy_are_the_local_path_itself(tmp_path):
  with paths.local_file(paths.path(tmp_path / "w.bin")) as name:
    assert name == str(tmp_path / "w.bin")
  with paths.local_copy(paths.path(tmp_path)) as directory:
    assert str(directory) == str(tmp_path)
