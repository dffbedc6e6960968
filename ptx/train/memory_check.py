"""Out of memory: the check before a run's first step, and the one message it and XLA's RESOURCE_EXHAUSTED give.

`check` compiles the job's step for the run's state (abstract: nothing is
allocated) and a batch of the config's shape, reads each program's memory
from XLA (`ptx.train.pod_fit.footprint`: the state from its shardings, each
program's other inputs, scratch, outputs and code) and refuses the run with
`OutOfMemory` when the step's peak exceeds `MARGIN` of the memory there is:
  GPU, TPU  per device, the allocator's `bytes_limit` less what it already
            holds (`Device.memory_stats()`)
  CPU       the whole host, every local device's share summed: the smaller of
            /proc/meminfo's MemAvailable and the cgroup's memory.max less its
            memory.current
The programs are compiled exactly as the step's first call compiles them
(same state shardings, batch layout and options), so that call takes them
from jax's cache of compiled programs instead of compiling again.

Checked: the steps with one program (SFT, DPO, fused GRPO) and host-reward
GRPO's sampler and learner, whose peak is the larger program plus the
batches sampled ahead. Not checked, said in the log: the engine and
episode GRPO kinds (their engine compiles a program per shape bucket while
it runs, and the learner's rollouts are laid out from its results), DPO with
a precomputed reference and host GRPO's group refill (batches the check does
not model), and devices that report no memory limit.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ptx.config import Config
from ptx.data.global_batch import to_global
from ptx.train import pod_fit
from ptx.train.job import Job
from ptx.train.state import TrainState

log = logging.getLogger(__name__)

# The share of the memory there is that the step's estimate may take. The rest is for what XLA's figures leave
# out: the runtime's own buffers (GPU libraries' workspaces), the host-side data pipeline and the pretrained
# weights' host copy while they are placed, allocator fragmentation.
MARGIN = 0.9


class OutOfMemory(RuntimeError):
  """The run stopped: a program did not fit the device's memory (XLA's RESOURCE_EXHAUSTED, or the check before it)."""


def out_of_memory(what: str, cfg: Config, job: Job) -> OutOfMemory:
  """`OutOfMemory` saying `what` happened, then naming the settings that size a step and how to lower each."""
  data, model = cfg.data, job.model
  rl = (f"; GRPO holds grpo.group_size={cfg.grpo.group_size} samples of up to grpo.max_response_tokens="
        f"{cfg.grpo.max_response_tokens} tokens a prompt" if job.algorithm.startswith("grpo") else "")
  adapters = "" if job.lora is not None else ", or train LoRA adapters (--lora.rank=16) instead of every weight"
  return OutOfMemory(
      f"{what}. A step holds data.batch_size={data.batch_size} rows of data.seq_len={data.seq_len} tokens through "
      f"model.n_layers={model.n_layers} layers{rl}. Lower them, split the batch into micro-batches "
      f"(train.grad_accum, now {cfg.train.grad_accum}), set model.remat=full (now {model.remat!r}: it keeps the "
      f"fewest activations) or a smaller model.logits_chunk (now {model.logits_chunk}), shard over more devices "
      f"(mesh.fsdp){adapters}. A run that stopped before its first metrics line and checkpoint is started again by "
      "the same command.")


def from_xla(error: jax.errors.JaxRuntimeError, cfg: Config, job: Job) -> OutOfMemory | None:
  """XLA's out-of-memory `error` as `out_of_memory`'s message, or None for other errors."""
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text and "Out of memory" not in text:
    return None
  return out_of_memory(f"out of device memory ({text.splitlines()[0][:200]})", cfg, job)


@dataclasses.dataclass(frozen=True)
class Estimate:
  """What the check measured: the step's peak where the limit applies, the limit, and the figures per device.

  Attributes:
    need: bytes the step needs: per device on accelerators, summed over this host's devices on CPU.
    limit: bytes there are, read before the state is allocated.
    where: where `limit` was read.
    devices: the devices `need` sums (1 on accelerators).
    footprint: the per-device figures (`ptx.train.pod_fit.Footprint`).
  """

  need: int
  limit: int
  where: str
  devices: int
  footprint: pod_fit.Footprint

  @property
  def fits(self) -> bool:
    """Whether `need` is within `MARGIN` of `limit`."""
    return self.need <= MARGIN * self.limit

  def __str__(self) -> str:
    over = f" over {self.devices} devices" if self.devices > 1 else ""
    programs = ", ".join(f"{name} {_size(p.total)}" for name, p in self.footprint.programs.items())
    return (f"a step needs about {_size(self.need)}{over} of the {_size(self.limit)} {self.where} (XLA's estimate "
            f"before the first step, per device: state {_size(self.footprint.state)}, programs {programs}, in flight "
            f"{_size(self.footprint.in_flight)})")


def _size(n: int) -> str:
  """`n` bytes in GB, or in MB below a tenth of a GB."""
  return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check(cfg: Config, job: Job, step: Any, state: TrainState, mesh: jax.sharding.Mesh,
          limit: tuple[int, str] | None = None) -> Estimate | None:
  """Compiles `step`'s programs for `state` and refuses the run when their peak exceeds `MARGIN` of `limit`.

  Args:
    cfg: the job's config.
    job: built from `cfg`.
    step: `job.step.build(...)`'s step object, not yet called.
    state: the run's state as ShapeDtypeStructs with their shardings (`ptx.train.state.abstract_state`).
    mesh: the run's mesh.
    limit: (bytes, where they were read) the step may use; None reads them (`available`).

  Returns:
    The estimate, which fits, or None when the step is not checked (module docstring).

  Raises:
    OutOfMemory: naming the estimate, the limit, where it was read and the settings to lower.
  """
  if not hasattr(step, "compile"):
    log.info("memory check: skipped, %s compiles its programs while it runs", type(step).__name__)
    return None
  try:
    host_batch = next(iter(pod_fit.host_batches(cfg, job)))
  except ValueError as e:
    log.info("memory check: skipped, %s", e)
    return None
  limit = limit or available(mesh)
  if limit is None:
    log.info("memory check: skipped, the devices report no memory limit")
    return None
  footprint = pod_fit.footprint(cfg, job, step, state, to_global(host_batch, mesh, job.rules))
  devices = len(mesh.local_devices) if mesh.devices.flat[0].platform == "cpu" else 1  # CPU devices share the host
  estimate = Estimate(footprint.total * devices, *limit, devices, footprint)
  refused = not estimate.fits
  if jax.process_count() > 1:  # all stop alike: the others would wait for it in the first step's collectives
    refused = bool(multihost_utils.process_allgather(np.int32(refused)).any())
  if not estimate.fits:
    raise out_of_memory(f"{estimate}, more than {MARGIN:.0%} of it; train.memory_check=false skips this check", cfg,
                        job)
  if refused:
    raise out_of_memory("another process's step does not fit its memory (its output gives the estimate)", cfg, job)
  return estimate


def available(mesh: jax.sharding.Mesh) -> tuple[int, str] | None:
  """(bytes, where read) that a step may use on this process: per device on accelerators, the host's on CPU."""
  devices = mesh.local_devices
  if devices[0].platform == "cpu":
    return _host_available()
  stats = [d.memory_stats() or {} for d in devices]
  if not all("bytes_limit" in s for s in stats):
    return None
  free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
  return free, f"free on each {devices[0].device_kind} (its allocator's bytes_limit less bytes_in_use)"


def _host_available() -> tuple[int, str] | None:
  """The host's memory this process may still take: MemAvailable, or the cgroup's room when smaller; None unknown."""
  try:
    meminfo = dict(line.split(":", 1) for line in pathlib.Path("/proc/meminfo").read_text().splitlines())
  except OSError:  # not Linux
    return None
  free, where = int(meminfo["MemAvailable"].split()[0]) * 1024, "available on the host (/proc/meminfo MemAvailable)"
  cgroup = pathlib.Path("/sys/fs/cgroup")
  try:
    room = int((cgroup / "memory.max").read_text()) - int((cgroup / "memory.current").read_text())
  except (OSError, ValueError):  # no cgroup v2 limit: no file, or "max"
    return free, where
  if room < free:
    return room, "left in the cgroup (/sys/fs/cgroup memory.max less memory.current)"
  return free, where
