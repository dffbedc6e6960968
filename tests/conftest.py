"""Test setup: 8 fake CPU devices (threads enough for them, LLVM -O0), strict numerics, one compile cache per run."""

import gc
import os
import shutil
import tempfile

# LLVM at -O0 instead of XLA:CPU's default: the suite's time is mostly compilation, and -O0 cut
# tests/models/test_decoder.py's CPU seconds by a third against -O1 (105 -> 71; 128 at the default).
# It rounds differently (no contraction or vectorisation of LLVM's own), which the tests' tolerances
# cover; the learning tests assert gains rather than figures, and the episode learning test's SFT
# runs until its model copies, the point -O0 once delayed past a fixed step count (12-04;
# benchmarks/RESULTS.md, "The test suite").
# An XLA_FLAGS that names a level keeps its own.
_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _FLAGS:
  _FLAGS += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gs:// in tests goes to a local GCS server (tests/train/test_object_storage.py) through gcsfs. Both settings
# are read once per process (epath caches its choice of TensorFlow's gfile, whose client has no emulator
# endpoint; gcsfs reads its flag at import, and its default asks a gRPC API with 60 s timeouts), so they are
# set here, before any test imports either.
os.environ.setdefault("EPATH_USE_TF", "false")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# XLA:CPU runs all 8 fake devices on one thread pool, sized max(cores, devices) = 8 here, and a
# collective blocks its thread until every peer arrives. A device may run collectives over two
# groups at once (tensor and data axes), so on a loaded machine all 8 threads can end up waiting for
# peers that have no thread left: XLA aborts the process after 40 s ("Termination timeout ...
# rendezvous"). Reproduced with tests/train/test_step.py::test_a_tiny_model_overfits_one_batch next
# to 6 busy loops; 8 threads per device never deadlocked there. Subprocesses inherit it.
os.environ.setdefault("PJRT_NPROC", "64")
# Tests build many identical programs through fresh jits (every init_state, every CLI subprocess), and
# XLA:CPU spends seconds on each. A persistent cache shared by this run's xdist workers and the
# subprocesses they start (which inherit the environment) compiles each of them once. Set
# PTX_TEST_COMPILE_CACHE=0 to compile everything afresh.
# The xdist controller loads this file first, so its workers inherit its directory.
_OWN_CACHE = (os.environ.get("PTX_TEST_COMPILE_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ
              and "PYTEST_XDIST_WORKER" not in os.environ)
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="ptx-test-jax-cache-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402  (must follow the XLA_FLAGS above)
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_threefry_partitionable", True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops the in-memory compiled programs after each test module.

  A whole run keeps several GB of executables and their buffers alive
  otherwise; later modules rarely reuse an earlier module's programs, and
  the persistent cache above still serves the ones they do.
  """
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture
def mesh():
  """A (data=2, tensor=4) mesh over the 8 fake devices."""
  from ptx.config import MeshConfig
  from ptx.sharding import make_mesh

  return make_mesh(MeshConfig(data=2, fsdp=1, tensor=4, seq=1))


@pytest.fixture
def tiny_config():
  """A float32 Llama-style config whose dimensions are pairwise distinct.

  Sharded dimensions are distinct multiples of the mesh sizes (heads 8,
  mlp 96, vocab 264) and unsharded ones are primes (head_dim 7 is odd, so
  RoPE uses head_dim 14), so a swapped axis cannot pass unnoticed.
  """
  from ptx.model_config import ModelConfig

  return ModelConfig(vocab_size=264, d_model=40, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=14,
                     mlp_dim=96, rope_theta=10_000.0, init_std=0.1)


@pytest.fixture(scope="module")
def ptx_checkpoint(tmp_path_factory):
  """An HF model directory: a random `model_variants.HF_ARCH` written by `save_hf`, with the byte tokenizer's files."""
  pytest.importorskip("tokenizers", reason="a checkpoint's tokenizer needs the hf extra (`make test` installs it)")
  from model_variants import HF_ARCH
  from ptx.data.tokenizer import ByteTokenizer
  from ptx.models import Decoder, init_params, save_hf

  path = tmp_path_factory.mktemp("ptx_ckpt")
  save_hf(Decoder(HF_ARCH, params=init_params(HF_ARCH, jax.random.key(3))), path)
  ByteTokenizer().save_hf(path)
  return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadfile` (`make test`'s) through a scheduler whose run ends after a worker crashes."""
  if config.getvalue("dist") != "loadfile":
    return None
  from crash_safe_scheduling import CrashSafeLoadFileScheduling

  return CrashSafeLoadFileScheduling(config, log)


def pytest_sessionfinish(session, exitstatus):
  """Removes the compilation cache this process created (the controller's, under xdist)."""
  if _OWN_CACHE:
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
