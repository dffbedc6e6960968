"""Long-context training: time and memory of the sequence-parallel model, one JSON line each.

  python benchmarks/long_context.py                  # 128K run on 8 CPU devices + 1M compile-only
  python benchmarks/long_context.py --skip-run       # compile-only figures
  python benchmarks/long_context.py --gpu-steps 5    # on a GPU: train at 1M tokens, tokens/s

The CPU run is one SFT forward+backward at `--run-tokens` (128K) tokens on 8
fake devices (`seq` = 8, ring attention in the zig-zag layout, remat, chunked
loss), timed after a warm-up, with the process's peak RSS. The compile-only
lines read `memory_analysis()` of a full training step (optimizer included) at
1M tokens over 8 devices and state the floor (`ptx.models.memory_floor`) it
is measured against. The GPU section runs only where JAX sees a GPU: it trains
the same small model at 1M tokens on that one device (Pallas attention, no
mesh) and prints tokens/s. Every line carries the load average.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("PJRT_NPROC", "64")  # 8 threads can deadlock 8 devices' collectives (tests/conftest.py)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ptx.algorithms import sft  # noqa: E402
from ptx.config import GRPOConfig, MeshConfig, OptimizerConfig  # noqa: E402
from ptx.model_config import ModelConfig
from ptx.models import init_params  # noqa: E402
from ptx.models.llama import smollm2_135m  # noqa: E402
from ptx.models.memory_floor import grpo_floor_bytes, training_floor_bytes  # noqa: E402
from ptx.models.params import weight_decay_mask  # noqa: E402
from ptx.sampling.generation import LENGTH, Generation  # noqa: E402
from ptx.sharding import batch_sharding, make_mesh, rules_of  # noqa: E402
from ptx.train.optimizer import make_optimizer  # noqa: E402
from ptx.train.grpo.update import RLSpec  # noqa: E402
from ptx.train.state import init_state, state_shardings  # noqa: E402
from ptx.train.step import make_train_step  # noqa: E402

MiB = 2**20
# The model of the 1M-token memory check.
MODEL_1M = ModelConfig(vocab_size=32768, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
                       mlp_dim=768, attention_impl="ring", remat="full", logits_chunk=1024)
# The same model on one GPU: Pallas attention, bfloat16 compute.
MODEL_1M_GPU = dataclasses.replace(MODEL_1M, attention_impl="pallas", compute_dtype="bfloat16")
# The SmolLM2-135M shape (30 layers, 9 heads, 3 KV heads, vocabulary 49,152) as a long-context GRPO policy: full
# remat, the one choice a long-context run makes; every other setting at its default (attention "auto", which is
# ring over the seq mesh, logits chunk, heads per ring pass, zig-zag layout, GRPO's loss, reference, staleness).
MODEL_SMOLLM2 = dataclasses.replace(smollm2_135m(), remat="full")
GRPO_ROWS = 2  # one group of two rollouts, each half prompt and half response
# A smaller one that runs 128K tokens on two CPU cores in minutes.
MODEL_CPU = ModelConfig(vocab_size=512, d_model=64, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=32, mlp_dim=128,
                        attention_impl="ring", remat="full", logits_chunk=1024)


def _load() -> float:
  """The 1-minute load average (other sessions share the machine)."""
  return round(os.getloadavg()[0], 2)


def _batch(cfg: ModelConfig, tokens: int) -> dict[str, np.ndarray]:
  """One row of `tokens` random tokens, one document, every token a target."""
  rng = np.random.default_rng(0)
  ones = np.ones((1, tokens), np.int32)
  return {"tokens": rng.integers(0, cfg.vocab_size, (1, tokens)).astype(np.int32), "loss_mask": ones,
          "segment_ids": ones, "positions": np.arange(tokens, dtype=np.int32)[None]}


def _train_step(cfg: ModelConfig, mesh):
  """(step, state shardings, abstract state) of the trainer's jitted SFT step."""
  optimizer = make_optimizer(OptimizerConfig(), 10, weight_decay_mask(cfg))
  shardings = state_shardings(cfg, optimizer, mesh)
  step = make_train_step(functools.partial(sft.loss, model=cfg), optimizer, mesh=mesh, state_shardings=shardings)
  return step, optimizer


def run_cpu(args):
  """Times one forward+backward at `--run-tokens` on 8 devices; prints time and peak RSS."""
  cfg, t = MODEL_CPU, args.run_tokens
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=8))
  params = init_params(cfg, jax.random.key(0))
  grad = jax.jit(jax.value_and_grad(functools.partial(sft.loss, model=cfg), has_aux=True))
  with jax.set_mesh(mesh):
    batch = jax.device_put(_batch(cfg, t), batch_sharding(mesh))
    start = time.perf_counter()
    jax.block_until_ready(grad(params, batch, None))
    first = time.perf_counter() - start
    start = time.perf_counter()
    (loss, _), _ = jax.block_until_ready(grad(params, batch, None))
    seconds = time.perf_counter() - start
  print(json.dumps(dict(
      bench="long_context_cpu_run", tokens=t, devices=8, model=_describe(cfg), loss=round(float(loss), 4),
      first_call_s=round(first, 2), fwd_bwd_s=round(seconds, 2), tokens_per_s=round(t / seconds),
      peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), load=_load())), flush=True)


def _per_device_bytes(mem) -> int:
  """What a compiled program holds per device: its arguments, outputs not aliased to them, and scratch."""
  return mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes


def compile_memory(cfg: ModelConfig, t: int, n: int, devices=None) -> dict:
  """Compile-only memory of a `t`-token training step over `n` devices (`seq` = n) against the stated floor.

  Args:
    cfg: the model.
    t: tokens of the one sequence.
    n: devices of the `seq` axis.
    devices: the devices (default: the first n).

  Returns:
    The JSON record: per-device MiB, the floor's parts and their ratio, compile seconds.
  """
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=n), devices)
  step, optimizer = _train_step(cfg, mesh)
  shardings = state_shardings(cfg, optimizer, mesh)
  with jax.set_mesh(mesh):
    state = jax.eval_shape(lambda: init_state(cfg, optimizer, 0, mesh))
    state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), state, shardings)
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=batch_sharding(mesh))
    start = time.perf_counter()
    mem = step.lower(state, dict.fromkeys(("tokens", "loss_mask", "segment_ids", "positions"), ids)).compile(
    ).memory_analysis()
  used = _per_device_bytes(mem)
  floor = training_floor_bytes(cfg, batch=1, seq_len=t, seq_shards=n)
  return dict(
      tokens=t, devices=n, model=_describe(cfg),
      per_device_mib=round(used / MiB), temp_mib=round(mem.temp_size_in_bytes / MiB),
      floor_mib={k: round(v / MiB) for k, v in floor.items()}, ratio_to_floor=round(used / floor["total"], 2),
      compile_s=round(time.perf_counter() - start, 1), load=_load())


def _grpo_learner(cfg: ModelConfig, mesh_cfg: MeshConfig, t: int):
  """(mesh, host-reward GRPO's update program, its state shardings, optimizer, GRPO config) for rows of `t` tokens.

  The program is the one `ptx grpo` runs between sampling and the next step
  (`HostRewardStep.learner`): the reference pass, the importance-corrected
  update of stale rollouts (the default `max_staleness`) and the optimizer.
  """
  # Imported here: rl_host needs grain, which the GPU image lacks, and device_check's memory section (SFT only)
  # imports this module there.
  from ptx.train.grpo.host import HostRewardStep
  mesh, rules = make_mesh(mesh_cfg), rules_of(mesh_cfg)
  grpo_cfg = GRPOConfig(group_size=GRPO_ROWS, max_response_tokens=t // 2)
  optimizer = make_optimizer(OptimizerConfig(), 10, weight_decay_mask(cfg))
  shardings = state_shardings(cfg, optimizer, mesh, rules, with_reference=grpo_cfg.uses_reference)
  spec = RLSpec(model=cfg, grpo=grpo_cfg, max_new_tokens=t // 2, stop_ids=(2,), rules=rules)
  step = HostRewardStep(spec=spec, optimizer=optimizer, mesh=mesh, state_shardings=shardings, reward=None,
                        prompts=None)
  return mesh, step.learner, shardings, optimizer, grpo_cfg


def _grpo_inputs(cfg: ModelConfig, mesh, t: int, *, abstract: bool):
  """(rollouts, gen, rewards) of one group of GRPO_ROWS rollouts of `t` tokens, as arrays or ShapeDtypeStructs."""
  rows, prompt = GRPO_ROWS, t // 2
  columns = np.arange(t, dtype=np.int32)[None].repeat(rows, 0)
  response = (columns >= prompt).astype(np.int32)
  rng = np.random.default_rng(0)
  logps = np.where(response, -rng.random((rows, t), np.float32), 0).astype(np.float32)
  rollouts = {"tokens": rng.integers(0, cfg.vocab_size, (rows, t)).astype(np.int32), "positions": columns,
              "segment_ids": np.ones((rows, t), np.int32), "loss_mask": response, "sampler_logps": logps}
  gen = Generation(tokens=rollouts["tokens"][:, prompt:], lengths=np.full(rows, t - prompt, np.int32),
                   finish_reasons=np.full(rows, LENGTH, np.int32), log_probs=logps[:, prompt:])
  rewards = np.arange(rows, dtype=np.float32)  # unequal, so the group has an advantage
  place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding(mesh, x.ndim))  # noqa: E731
  if not abstract:
    place = lambda x: jax.device_put(x, batch_sharding(mesh, x.ndim))  # noqa: E731
  return jax.tree.map(place, rollouts), jax.tree.map(place, gen), place(rewards)


def grpo_compile_memory(cfg: ModelConfig, t: int, n: int) -> dict:
  """Compile-only memory of host-reward GRPO's update over GRPO_ROWS rollouts of `t` tokens on `seq` = n devices.

  Returns:
    The JSON record: per-device MiB against `grpo_floor_bytes`, its parts and the ratio, compile seconds.
  """
  mesh, learner, shardings, optimizer, grpo_cfg = _grpo_learner(cfg, MeshConfig(data=1, fsdp=1, tensor=1, seq=n), t)
  with jax.set_mesh(mesh):
    state = jax.eval_shape(lambda: init_state(cfg, optimizer, 0, mesh, with_reference=grpo_cfg.uses_reference))
    state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), state, shardings)
    start = time.perf_counter()
    mem = learner.lower(state, *_grpo_inputs(cfg, mesh, t, abstract=True)).compile().memory_analysis()
  used = _per_device_bytes(mem)
  floor = grpo_floor_bytes(cfg, rows=GRPO_ROWS, seq_len=t, seq_shards=n, with_reference=grpo_cfg.uses_reference)
  return dict(
      rows=GRPO_ROWS, tokens_per_row=t, devices=n, model=_describe(cfg), per_device_mib=round(used / MiB),
      temp_mib=round(mem.temp_size_in_bytes / MiB), floor_mib={k: round(v / MiB) for k, v in floor.items()},
      ratio_to_floor=round(used / floor["total"], 2), compile_s=round(time.perf_counter() - start, 1), load=_load())


def run_grpo(cfg: ModelConfig, t: int, mesh_cfg: MeshConfig) -> dict:
  """Runs host-reward GRPO's update once (after a compiling call) on GRPO_ROWS rollouts of `t` tokens.

  Returns:
    The JSON record: the step's seconds and CPU seconds, its compiled per-device memory, the process's peak RSS.
  """
  mesh, learner, _, optimizer, grpo_cfg = _grpo_learner(cfg, mesh_cfg, t)
  with jax.set_mesh(mesh):
    state = init_state(cfg, optimizer, 0, mesh, rules_of(mesh_cfg), with_reference=grpo_cfg.uses_reference)
    inputs = _grpo_inputs(cfg, mesh, t, abstract=False)
    compiled = learner.lower(state, *inputs).compile()
    mem = compiled.memory_analysis()
    state, metrics = jax.block_until_ready(compiled(state, *inputs))
    wall, cpu = time.perf_counter(), time.process_time()
    state, metrics = jax.block_until_ready(compiled(state, *inputs))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  used = _per_device_bytes(mem)
  return dict(
      rows=GRPO_ROWS, tokens_per_row=t, mesh=dataclasses.asdict(mesh_cfg), model=_describe(cfg),
      step_s=round(wall, 2), cpu_s=round(cpu, 2), loss=round(float(metrics["loss"]), 4),
      per_device_mib=round(used / MiB), peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
      load=_load())


def train_gpu(args):
  """Trains the 1M-token model on the one GPU for `--gpu-steps` steps; prints tokens/s."""
  cfg, t = MODEL_1M_GPU, 2**20
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=1), jax.devices()[:1])
  step, optimizer = _train_step(cfg, mesh)
  with jax.set_mesh(mesh):
    state = init_state(cfg, optimizer, 0, mesh)
    batch = jax.device_put(_batch(cfg, t), batch_sharding(mesh))
    state, metrics = step(state, batch)  # compile
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(args.gpu_steps):
      state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start) / args.gpu_steps
  stats = jax.devices()[0].memory_stats() or {}
  print(json.dumps(dict(
      bench="long_context_gpu_train", tokens=t, device=jax.devices()[0].device_kind, model=_describe(cfg),
      step_s=round(seconds, 3), tokens_per_s=round(t / seconds), loss=round(float(metrics["loss"]), 4),
      peak_gpu_mib=round(stats.get("peak_bytes_in_use", 0) / MiB), load=_load())), flush=True)


def _describe(cfg: ModelConfig) -> str:
  """A short model description for the JSON lines."""
  return (f"L{cfg.n_layers} d{cfg.d_model} h{cfg.n_heads}/{cfg.n_kv_heads}x{cfg.head_dim} mlp{cfg.mlp_dim} "
          f"V{cfg.vocab_size} {cfg.attention_impl} remat={cfg.remat} chunk={cfg.logits_chunk}")


def main():
  """Parses flags and prints every measurement."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--run-tokens", type=int, default=131072)
  parser.add_argument("--skip-run", action="store_true")
  parser.add_argument("--skip-compile", action="store_true")
  parser.add_argument("--gpu-steps", type=int, default=3)
  parser.add_argument("--grpo", action="store_true",
                      help="the SmolLM2-shape GRPO update instead: compile memory at 32K and 1M tokens per row")
  parser.add_argument("--grpo-run-tokens", type=int, default=0,
                      help="with --grpo, also run the update at this many tokens per row on (fsdp 2, seq 4)")
  args = parser.parse_args()
  if jax.default_backend() == "gpu":
    train_gpu(args)
    return
  if args.grpo:
    for t in (2**15, 2**20):
      print(json.dumps(dict(bench="long_context_grpo_compile", **grpo_compile_memory(MODEL_SMOLLM2, t, 8))),
            flush=True)
    if args.grpo_run_tokens:
      mesh_cfg = MeshConfig(data=1, fsdp=2, tensor=1, seq=4)  # the state sharded: 8 replicas would not fit the host
      print(json.dumps(dict(bench="long_context_grpo_run", **run_grpo(MODEL_SMOLLM2, args.grpo_run_tokens, mesh_cfg))),
            flush=True)
    return
  if not args.skip_compile:
    print(json.dumps(dict(bench="long_context_1m_compile", **compile_memory(MODEL_1M, 2**20, 8))), flush=True)
  if not args.skip_run:
    run_cpu(args)


if __name__ == "__main__":
  main()
