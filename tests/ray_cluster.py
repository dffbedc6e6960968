"""A local multi-node Ray cluster for tests: a head and one worker node, one CPU slot each (this machine has 2 cores).

Only the worker node declares the custom resource "sandbox", so a job that asks for it runs on a node other than
the head (the test's own). Used as a module-scoped fixture: `cluster = ray_cluster.fixture()`.
"""

import os
import pathlib

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402


def fixture():
  """A module-scoped pytest fixture yielding the started Cluster, this process connected to it."""

  @pytest.fixture(scope="module")
  def cluster():
    started = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    started.add_node(num_cpus=1, resources={"sandbox": 1})
    # log_to_driver off keeps the workers' output (sandboxed programs') out of pytest's. The jobs' functions are
    # pickled by name, so the workers import test modules as pytest named them: by file name, from their folders.
    tests = pathlib.Path(__file__).resolve().parent
    folders = [tests, *sorted(p for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))]
    path = os.pathsep.join(str(f) for f in folders)
    ray.init(address=started.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    started.wait_for_nodes()
    yield started
    ray.shutdown()
    started.shutdown()

  return cluster
