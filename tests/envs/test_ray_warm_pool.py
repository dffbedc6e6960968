"""ptx.envs.warm_pool on Ray: set-ups run as Ray tasks on the cluster's nodes and give the bytes they give here.

The process's small cluster serves the module (`ray_cluster`: a head and a worker node, one CPU slot each).
"""

import hashlib

import pytest

ray = pytest.importorskip("ray")

import ray_cluster  # noqa: E402
from ptx.scheduling import scheduler  # noqa: E402
from ptx.envs import warm_pool
from ptx.scheduling.work import Resources  # noqa: E402
from ptx.scheduling.ray_executor import RayExecutor  # noqa: E402

SETUP = "seq 1 300 > data.txt && mkdir -p build && cat task.txt data.txt > build/all.txt"


cluster = ray_cluster.fixture()


def test_workspaces_prepared_on_the_nodes_are_the_ones_prepared_here(cluster):
  states = [warm_pool.InitialState.of({"task.txt": f"task {i}\n"}, SETUP) for i in range(4)]
  here = {s.key: warm_pool.prepare(s).digest for s in states}
  executor = RayExecutor(resources=Resources(num_cpus=1))
  with warm_pool.WarmPool(size=8, concurrency=2, executor=executor,
                          retry=scheduler.Retry(attempts=2, base_s=0.0, jitter=0.0)) as pool:
    pool.expect(states * 2)
    leases = [pool.checkout(s) for s in states * 2]
    for state, lease in zip(states * 2, leases):
      workspace = lease.workspace()
      assert hashlib.sha256(workspace.snapshot).hexdigest() == here[state.key]
      assert workspace.files()["build/all.txt"].startswith(f"task {states.index(state)}\n1\n2\n".encode())
    assert pool.stats["prepared"] == 4 and pool.stats["handed_out"] == 8  # one preparation per state
    # A set-up that fails on a node is retried there as an infrastructure fault, then reported as one.
    broken = pool.checkout(warm_pool.InitialState.of({}, "echo no >&2; exit 2"))
    with pytest.raises(scheduler.InfraError, match="exit"):
      broken.workspace()
    assert pool.stats["retries"] == 1 and pool.stats["failed"] == 1
