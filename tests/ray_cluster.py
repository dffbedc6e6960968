"""A local multi-node Ray cluster for tests: a head and one worker node, one CPU slot each (this machine has 2 cores).

Only the worker node declares the custom resource "sandbox", so a job that asks for it runs on a node other than
the head (the test's own). One cluster serves every module of a pytest process that uses it, as starting one takes
seconds: `cluster = ray_cluster.fixture()` is a module-scoped fixture that connects this process to it and
disconnects at the module's end (the module's Ray workers, which import what its jobs import, end then); the
cluster's processes end with this one. A test that adds nodes removes them, or kills them, before it ends.
"""

import os
import pathlib

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

# A killed node is declared dead after 3 missed health checks a second apart (Ray's default: 5, 3 s apart), so a
# result it held is lost, and the cluster whole again, within seconds. A live node answers each check within 10 s
# (Ray's default timeout), so a loaded machine still has to stall it for half a minute to have it declared dead.
_SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
_started: list[Cluster] = []  # this process's cluster, once started


def _cluster() -> Cluster:
  """This process's cluster, started at the first call (no autoscaler or log monitor: nothing here reads them)."""
  if not _started:
    head = {"num_cpus": 1, "include_dashboard": False, "no_monitor": True, "include_log_monitor": False,
            "_system_config": _SYSTEM_CONFIG}
    started = Cluster(initialize_head=True, head_node_args=head)
    started.add_node(num_cpus=1, resources={"sandbox": 1})
    _started.append(started)
  return _started[0]


def fixture():
  """A module-scoped pytest fixture yielding the process's Cluster, this process connected to it."""

  @pytest.fixture(scope="module")
  def cluster():
    started = _cluster()
    # log_to_driver off keeps the workers' output (sandboxed programs') out of pytest's. The jobs' functions are
    # pickled by name, so the workers import test modules as pytest named them: by file name, from their folders.
    tests = pathlib.Path(__file__).resolve().parent
    folders = [tests, *sorted(p for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))]
    path = os.pathsep.join(str(f) for f in folders)
    ray.init(address=started.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    # A node an earlier module killed counts as live until its health checks fail: the module starts after that.
    started.wait_for_nodes()
    yield started
    ray.shutdown()

  return cluster
