"""Whether a job fits a pod: its step's programs compiled for the pod's mesh on fake CPU devices, per-device memory.

`check(cfg, job, pod)` builds the job's step exactly as `ptx.train.loop.fit`
does (the Job's optimizer, `state_shardings`, `job.step.build`, batches
placed by `to_global`), compiles every program of one step from an abstract
state (`jax.ShapeDtypeStruct`s with their shardings: no parameter is ever
allocated) and reads each program's per-device memory from XLA
(`memory_analysis()`). The process needs at least `pod.chips` devices: a
test or script fakes them with `jax_num_cpu_devices` before JAX starts
(`benchmarks/pod_fit.py` runs each pod preset in a process of its own), so
the mesh, and every per-device shape, is the pod's own; a smaller mesh with
scaled shapes would not be, since FSDP shards parameters by the chip count.

What the figures are, per device:
  state      parameters, optimizer state and the frozen reference (or the
             LoRA base), summed from their shardings: exact, as on the pod
             (up to TPU tile padding of small dimensions)
  programs   for each compiled program, what it holds beyond the resident
             state: its other inputs (the batch, or rollouts), its scratch
             (`temp`), the outputs that do not overwrite a donated input and
             its generated code (none on XLA:CPU)
  in flight  host-reward GRPO: the `grpo.max_staleness` rollout batches
             sampled ahead, alive while the other program runs
  total      state + the largest program + in flight, against the chip's HBM

The programs' scratch is XLA:CPU's, not the TPU compiler's. CPU runs bfloat16
matmuls through float32 copies of their operands and fuses less, which
inflates scratch; the TPU compiler also rematerialises to fit HBM. The TPU
may instead keep more parameter all-gathers in flight (its scheduler
prefetches them) and pads arrays to its tiles. So the total is an estimate
that is typically high for bfloat16 models, not a bound either way: "fits"
is a safe verdict on the state and a probable one on the whole; "does not
fit" by the scratch alone calls for a TPU compile before changing the
config. The CPU-only code paths (`ptx_kernels.xla_cpu_workarounds`) are off
while compiling, so the programs are the ones a TPU runs.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import numpy as np
from ptx_kernels import xla_cpu_workarounds

from ptx import sharding
from ptx.config import Config
from ptx.data.batcher import Batcher
from ptx.data.global_batch import to_global
from ptx.data.tokenizer import ByteTokenizer
from ptx.train.job import Job
from ptx.train.state import TrainState, abstract_state, init_state, state_shardings
from ptx.train.streams import grpo_prompts

GiB = 2**30
# Memory per chip that programs may use, in GiB. TPUs: Cloud TPU's published HBM per chip (v5p: 95 GiB of its 96,
# the rest kept by the runtime). GPUs: the vendor's capacity (XLA preallocates 75% of it unless
# XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise).
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "h100": 80, "h200": 141}
# TPU slice names count TensorCores: two per chip on v4 and v5p ("v5p-32" is 16 chips), one on v5e and v6e.
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
# LLVM's optimisation of the generated CPU code: off, which halves compile time; buffer sizes come from the HLO
# passes before it, so `memory_analysis()` is the same (measured: equal on 2-layer 7B GRPO programs).
_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass(frozen=True)
class Pod:
  """A set of `chips` accelerators of one kind (a key of `HBM_GIB`)."""

  chip: str
  chips: int

  def __post_init__(self):
    if self.chip not in HBM_GIB:
      raise ValueError(f"Pod.chip: unknown chip {self.chip!r}; known: {sorted(HBM_GIB)}")
    if self.chips < 1:
      raise ValueError(f"Pod.chips must be >= 1, got {self.chips}")

  @property
  def hbm_gib(self) -> float:
    """HBM per chip in GiB."""
    return HBM_GIB[self.chip]


def tpu_slice(name: str) -> Pod:
  """The Pod of a Cloud TPU slice name such as "v5p-64" (32 chips) or "v5e-8" (8 chips).

  Raises:
    ValueError: naming the slice when it is not "<v4|v5p|v5e|v6e>-<TensorCores>".
  """
  match = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", name)
  if match is None or int(match[2]) % _CORES_PER_CHIP[match[1]]:
    raise ValueError(f"TPU slice {name!r}: expected <{'|'.join(_CORES_PER_CHIP)}>-<TensorCores>, e.g. v5p-64")
  return Pod(match[1], int(match[2]) // _CORES_PER_CHIP[match[1]])


@dataclasses.dataclass(frozen=True)
class Program:
  """One compiled program's per-device bytes beyond the resident state (module docstring)."""

  inputs: int  # arguments that are not the state (batch, rollouts)
  temp: int  # XLA's scratch
  outputs: int  # outputs that do not overwrite a donated input
  code: int  # the generated code on the device (0 on XLA:CPU, whose code lives in host memory)

  @property
  def total(self) -> int:
    """Bytes per device the program adds to the state while it runs."""
    return self.inputs + self.temp + self.outputs + self.code


@dataclasses.dataclass(frozen=True)
class Footprint:
  """Per-device memory of a job's step on a mesh (module docstring).

  Attributes:
    params, opt_state, reference: bytes per device of those parts of the
      state, from their shardings (reference: the frozen copy or the LoRA
      base; 0 without).
    state: bytes per device of the whole state (the parts above plus step
      and rng).
    programs: each program of a step by name.
    in_flight: bytes of batches sampled ahead (host-reward GRPO).
  """

  params: int
  opt_state: int
  reference: int
  state: int
  programs: dict[str, Program]
  in_flight: int

  @property
  def total(self) -> int:
    """Bytes per device at the step's peak: the state, the largest program and the batches in flight."""
    return self.state + max(p.total for p in self.programs.values()) + self.in_flight


@dataclasses.dataclass(frozen=True)
class Fit(Footprint):
  """A Footprint on a pod, and the verdict (module docstring).

  Attributes:
    pod: the pod.
    mesh: the mesh's axis sizes.
    compile_s: seconds spent lowering and compiling.
  """

  pod: Pod
  mesh: dict[str, int]
  compile_s: float

  @property
  def fits(self) -> bool:
    """Whether the peak fits the chip's HBM."""
    return self.total <= self.pod.hbm_gib * GiB

  @property
  def headroom_gib(self) -> float:
    """HBM left per device at the peak (negative: missing)."""
    return self.pod.hbm_gib - self.total / GiB

  def record(self) -> dict[str, Any]:
    """The figures as JSON-able GiB per device."""
    gib = lambda n: round(n / GiB, 3)
    return {"chip": self.pod.chip, "chips": self.pod.chips, "mesh": self.mesh, "params_gib": gib(self.params),
            "opt_state_gib": gib(self.opt_state), "reference_gib": gib(self.reference), "state_gib": gib(self.state),
            "programs_gib": {name: {"inputs": gib(p.inputs), "temp": gib(p.temp), "outputs": gib(p.outputs),
                                    "code": gib(p.code)}
                             for name, p in self.programs.items()},
            "in_flight_gib": gib(self.in_flight), "total_gib": gib(self.total), "hbm_gib": self.pod.hbm_gib,
            "fits": self.fits, "headroom_gib": round(self.headroom_gib, 3), "compile_s": round(self.compile_s, 1)}


def check(cfg: Config, job: Job, pod: Pod) -> Fit:
  """Compiles one step of `job` for `pod` (nothing runs) and measures its per-device memory.

  Args:
    cfg: the job's config; `cfg.mesh` is resolved over `pod.chips` devices.
    job: built from `cfg` (`ptx.sft_job`, `dpo_job`, `grpo_job`, `grpo_host_job`).
    pod: the chips; this process must have at least `pod.chips` devices.

  Returns:
    The Fit: exact state bytes, XLA's figures per program, the verdict.

  Raises:
    ValueError: this process has fewer devices than the pod has chips, or
      the job's data is one the check does not model (named).
  """
  devices = jax.devices()
  if len(devices) < pod.chips:
    raise ValueError(f"pod_fit: {pod.chips} {pod.chip} chips need {pod.chips} devices, this process has "
                     f"{len(devices)}; start it with jax.config.update('jax_num_cpu_devices', {pod.chips}) before "
                     "JAX initialises (benchmarks/pod_fit.py does)")
  mesh = sharding.make_mesh(cfg.mesh, devices[:pod.chips])
  started = time.perf_counter()
  with xla_cpu_workarounds.override(False):
    optimizer = job.optimizer()
    shardings = state_shardings(job.model, optimizer, mesh, job.rules, with_reference=job.with_reference,
                                lora=job.lora)
    start = lambda: init_state(job.model, optimizer, cfg.train.seed, mesh, job.rules,
                               with_reference=job.with_reference, lora=job.lora)
    state = abstract_state(shardings, start)
    data = job.step.stream(iter(host_batches(cfg, job)))
    step = job.step.build(optimizer, mesh, shardings, data)
    measured = footprint(cfg, job, step, state, to_global(next(data), mesh, job.rules), _COMPILER_OPTIONS)
  compile_s = time.perf_counter() - started
  return Fit(pod=pod, mesh=dict(mesh.shape), compile_s=compile_s,
             **{field.name: getattr(measured, field.name) for field in dataclasses.fields(Footprint)})


def footprint(cfg: Config, job: Job, step: Any, state: TrainState, batch: dict[str, Any],
              compiler_options: dict[str, Any] | None = None) -> Footprint:
  """Compiles every program of one step of `job` (nothing runs) and reads its per-device memory from XLA.

  Args:
    cfg: the job's config.
    job: built from `cfg`.
    step: `job.step.build(...)`'s step object; it must have `compile` (not the engine and episode kinds).
    state: the state, as arrays or as ShapeDtypeStructs with their shardings (`abstract_state`).
    batch: a global batch of the step's first (arrays or ShapeDtypeStructs).
    compiler_options: XLA options for the compilation; None compiles the programs a call of the step runs, which
      jax then reuses for that call.

  Returns:
    The state's bytes from its shardings, XLA's figures for each program.
  """
  compiled = step.compile(state, batch, compiler_options)
  ahead = cfg.grpo.max_staleness if job.algorithm == "grpo_host" else 0
  return Footprint(params=_bytes(state.params), opt_state=_bytes(state.opt_state),
                   reference=_bytes(state.ref_params) + _bytes(state.base), state=_bytes(state),
                   programs={name: _program(c, state) for name, c in compiled.items()},
                   in_flight=ahead * (compiled["sample"].memory_analysis().output_size_in_bytes if ahead else 0))


def host_batches(cfg: Config, job: Job) -> Any:
  """The host batches `fit` would read for `cfg`'s shapes: empty rows of the pipeline's layout, or dummy prompts."""
  tokenizer = ByteTokenizer()  # ids only fill arrays; their values change no shape
  if job.algorithm in ("grpo", "grpo_host"):
    if job.algorithm == "grpo_host" and cfg.grpo.filter_groups == "refill":
      raise ValueError("pod_fit: host-reward GRPO with grpo.filter_groups='refill' regroups rollouts on the host, "
                       "which the check does not model")
    return grpo_prompts(cfg, tokenizer, _DummyTasks(), in_graph=job.algorithm == "grpo")
  if cfg.data.kind == "preference" and cfg.dpo.reference_model == "precomputed":
    raise ValueError("pod_fit: dpo.reference='precomputed' adds the reference table's columns to each batch, "
                     "which the check does not model")
  # This host's rows, as the pipeline reads them.
  batcher = Batcher(cfg.data.kind, cfg.data.seq_len, cfg.data.batch_size // jax.process_count(), tokenizer.pad_id,
                    cfg.data.pack, 1)
  return [batcher.batch()]


class _DummyTasks:
  """Endless one-token prompts with a one-digit answer: prompt batches of the config's shape."""

  def __getitem__(self, index: int) -> dict[str, str]:
    return {"prompt": "1", "answer": "2"}


def _bytes(tree: Any) -> int:
  """Per-device bytes of a tree of ShapeDtypeStructs with shardings."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _program(compiled: jax.stages.Compiled, state: TrainState) -> Program:
  """A compiled program's bytes beyond the state: its first argument, whose unused leaves XLA dropped."""
  mem = compiled.memory_analysis()
  kept = jax.tree.map(lambda x, s: 0 if s is None else _bytes(x), state, compiled.input_shardings[0][0])
  kept = sum(jax.tree.leaves(kept))
  return Program(inputs=mem.argument_size_in_bytes - kept, temp=mem.temp_size_in_bytes,
                 outputs=mem.output_size_in_bytes - mem.alias_size_in_bytes, code=mem.generated_code_size_in_bytes)
