"""Expert parallelism: the all-to-all MoE layer against the dense reference, its collectives, its capacity, and what
the losses and samplers do with the tokens a lowered capacity drops."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptx import config_rules, sharding
from ptx.algorithms import dpo, grpo, sft
from ptx.config import Config, ConfigError, DPOConfig, GRPOConfig, MeshConfig
from ptx.model_config import ModelConfig, MoeConfig
from ptx.models import expert_parallel, init_params, moe
from ptx.models.chunked_logits import token_stats
from ptx.models.decoder import forward, hidden_states, hidden_with_cache
from ptx.models.gated_mlp import activation_of
from ptx.models.kv_cache import init_cache
from ptx.models.params import param_specs
from ptx.sampling.generation import generate_padded
from ptx.sampling.rules import SamplingConfig

# Pairwise distinct: F 12 belongs to expert weights only, T 5 to token arrays only (the HLO test tells arrays apart
# by them); B 8 splits over the 8 devices of every mesh below.
CFG = ModelConfig(vocab_size=264, d_model=40, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=14, mlp_dim=96,
                  init_std=0.1, moe=MoeConfig(n_experts=8, experts_per_token=2, expert_mlp_dim=12, router_bias=True))
B, T, F = 8, 5, 12
MESHES = {"data2_expert4": dict(data=2, fsdp=1, expert=4, tensor=1),
          "fsdp2_expert4": dict(data=1, fsdp=2, expert=4, tensor=1),
          "expert4_tensor2": dict(data=1, fsdp=1, expert=4, tensor=2)}


def assert_close(got, want):
  """Leaf by leaf to 1e-4 of the leaf's largest entry: the issue's bound; float32 sums reordered, seen up to 2.0e-6."""
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(np.abs(b).max())), got, want)


def _mesh(name):
  return sharding.make_mesh(MeshConfig(seq=1, **MESHES[name]))


def _layer(seed=0, cfg=CFG):
  """One MoE layer's parameters, perturbed so that the router bias matters and the experts differ."""
  layer = jax.tree.map(lambda w: w[0], init_params(cfg, jax.random.key(seed))["layers"])
  layer = {name: layer[name] for name in ("router", "router_bias", *moe.EXPERT_WEIGHTS) if name in layer}
  keys = jax.random.split(jax.random.key(seed + 1), len(layer))
  return {name: w + 0.3 * jax.random.normal(key, w.shape) for (name, w), key in zip(sorted(layer.items()), keys)}


def _placed(p, h, mesh, cfg=CFG):
  axes = {name: spec.logical_axes[1:] for name, spec in param_specs(cfg)["layers"].items() if name in p}
  tokens = sharding.named_shardings(("batch", "seq", None), h, mesh, kind="activations")
  return jax.device_put(p, sharding.named_shardings(axes, p, mesh)), jax.device_put(h, tokens)


def _mlp(p, h, impl, capacity_factor=None, cfg=CFG):
  cfg = dataclasses.replace(cfg, moe_impl=impl, moe_capacity_factor=capacity_factor)
  return moe.moe_mlp(p, h, cfg, token_mask=jnp.ones(h.shape[:2], bool), rules=sharding.DEFAULT_RULES)


def _value_and_grad(impl, cfg=CFG):
  return jax.jit(jax.value_and_grad(lambda p, h: jnp.sum(jnp.sin(_mlp(p, h, impl, cfg=cfg)[0])), argnums=(0, 1)))


@pytest.mark.parametrize("mesh_name, batch", [(None, B), *((name, B) for name in MESHES), ("data2_expert4", 2)],
                         ids=["one_device", *MESHES, "data2_expert4_batch2"])
def test_expert_parallel_equals_dense_forward_and_gradients(mesh_name, batch):
  """On one device and split over `expert` (with data, fsdp or tensor beside it): the dense reference's numbers.

  A batch of 2 cannot split over data x expert: each expert device holds the same tokens and routes them all.
  """
  p, h = _layer(), jax.random.normal(jax.random.key(2), (batch, T, CFG.d_model))
  want = _value_and_grad("dense")(p, h)
  if mesh_name is None:
    got = _value_and_grad("expert_parallel")(p, h)
  else:
    mesh = _mesh(mesh_name)
    with jax.set_mesh(mesh):
      got = _value_and_grad("expert_parallel")(*_placed(p, h, mesh))
    assert got[1][0]["expert_gate"].sharding.spec[0] == "expert"  # each device holds 2 of the 8 experts
  assert_close(got, want)
  assert float(jnp.abs(got[1][0]["router"]).sum()) > 0  # the router learns through the gate weights


# gpt-oss's experts: a bias on each projection and the SwiGLU clamped (at 1: these weights pass it).
GPT_OSS_EXPERTS = dataclasses.replace(CFG, activation="clamped_swiglu", swiglu_limit=1.0,
                                      moe=dataclasses.replace(CFG.moe, expert_bias=True))


@pytest.mark.parametrize("mesh_name", ["data2_expert4", "expert4_tensor2"])
def test_expert_biases_and_the_clamped_swiglu_equal_dense(mesh_name):
  """Each slot adds its expert's bias rows; with hidden units over tensor, the down projection's on one slice only."""
  cfg = GPT_OSS_EXPERTS
  p, h = _layer(cfg=cfg), jax.random.normal(jax.random.key(2), (B, T, CFG.d_model))
  want = _value_and_grad("dense", cfg)(p, h)
  mesh = _mesh(mesh_name)
  with jax.set_mesh(mesh):
    got = _value_and_grad("expert_parallel", cfg)(*_placed(p, h, mesh, cfg))
  assert got[1][0]["expert_down_bias"].sharding.spec[0] == "expert"
  assert_close(got, want)
  assert float(jnp.abs(want[1][0]["expert_down_bias"]).sum(axis=-1).min()) > 0  # every expert's bias learns


def test_auto_is_expert_parallel_where_the_mesh_has_an_expert_axis():
  with jax.set_mesh(_mesh("data2_expert4")):
    assert moe.resolve_impl("auto") == "expert_parallel"
  with jax.set_mesh(sharding.make_mesh(MeshConfig(data=2, fsdp=4))):
    assert moe.resolve_impl("auto") == "dense"  # on a CPU, without expert parallelism


def _dropped_copies(ids, devices, capacity):
  """Numpy, bool [B, T, k]: each device's copies past `capacity` in their expert's queue, in token order."""
  dropped = np.zeros(ids.shape, bool)
  for rows in np.split(np.arange(ids.shape[0]), devices):
    seen = {}
    for b, t, i in np.ndindex(len(rows), *ids.shape[1:]):
      e = ids[rows[b], t, i]
      seen[e] = seen.get(e, 0) + 1
      dropped[rows[b], t, i] = seen[e] > capacity
  return dropped


def test_a_lowered_capacity_drops_copies_counts_them_and_leaves_the_rest_exact():
  """Capacity factor 1 on data2_expert4: a sequence of 5 tokens a device, C = ceil(5 x 2 / 8) = 2 copies an expert."""
  p, h = _layer(), jax.random.normal(jax.random.key(3), (B, T, CFG.d_model))
  mesh = _mesh("data2_expert4")
  with jax.set_mesh(mesh):
    y, stats = jax.jit(lambda p, h: _mlp(p, h, "expert_parallel", capacity_factor=1.0)[:2])(*_placed(p, h, mesh))
  routes = moe.route(moe.router_logits(p, h), CFG.moe)
  capacity = expert_parallel.capacity(T, 2, 8, 1.0)
  assert capacity == 2
  dropped = _dropped_copies(np.asarray(routes.ids), 8, capacity)
  assert 0 < dropped.sum() < dropped.size
  assert float(stats["tokens_dropped"]) == pytest.approx(dropped.mean(), rel=1e-6)
  # A dropped copy adds nothing: the dense reference with those copies' gate weights zeroed.
  want = moe._dense_experts(h, moe.Routes(routes.ids, routes.weights * ~dropped), p, activation_of(CFG))
  assert_close(y, want)


def _replica_groups(line: str) -> np.ndarray:
  """The device groups [G, S] of one HLO collective, in any of the three forms XLA prints."""
  if m := re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line):
    return np.asarray([[int(d) for d in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m.group(1))])
  if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
    dims = [int(d) for d in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    ids = ids.transpose([int(d) for d in m.group(4).split(",")]) if m.group(4) else ids
    return ids.reshape(int(m.group(1)), int(m.group(2)))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  names = re.findall(r"'(\w+)'=(\d+)", m.group(1))
  chosen = [i for i, (name, _) in enumerate(names) if f"'{name}'" in m.group(2)]
  ids = np.arange(math.prod(int(n) for _, n in names)).reshape([int(n) for _, n in names])
  ids = np.moveaxis(ids, chosen, range(len(names) - len(chosen), len(names)))
  return ids.reshape(-1, math.prod(ids.shape[len(names) - len(chosen):]))


def _over_expert(line: str, mesh) -> bool:
  """Whether a collective's groups join devices at different places along the mesh's `expert` axis."""
  coords = np.unravel_index(_replica_groups(line), mesh.devices.shape)[mesh.axis_names.index("expert")]
  return bool((coords != coords[:, :1]).any())


@pytest.fixture(scope="module")
def ep_step():
  """A 2-layer scanned MoE decoder's loss and gradients on fsdp2_expert4, compiled: (mesh, HLO text, its numbers)."""
  cfg = dataclasses.replace(CFG, moe_impl="expert_parallel")
  params = init_params(cfg, jax.random.key(4))
  tokens = jax.random.randint(jax.random.key(5), (B, T + 1), 0, cfg.vocab_size)
  inputs, targets = tokens[:, :-1], jax.nn.one_hot(tokens[:, 1:], cfg.vocab_size)

  def loss(params, inputs, targets, cfg):
    logits = forward(params, inputs, cfg)  # float32, as are the log-softmax and the loss
    return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1))

  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=3)
  want = value_and_grad(params, inputs, targets, dataclasses.replace(cfg, moe_impl="dense"))
  mesh = _mesh("fsdp2_expert4")
  shardings = sharding.named_shardings(jax.tree.map(lambda s: s.logical_axes, param_specs(cfg)), params, mesh)
  args = (jax.device_put(params, shardings), jax.device_put(inputs, sharding.batch_sharding(mesh)),
          jax.device_put(targets, sharding.batch_sharding(mesh, 3)))
  with jax.set_mesh(mesh):
    step = value_and_grad.lower(*args, cfg).compile()
    got = step(*args)
  return mesh, step.as_text(), got, want


def test_a_scanned_expert_parallel_step_equals_dense(ep_step):
  _, _, got, want = ep_step
  assert_close(got, want)


def test_the_step_has_two_all_to_alls_per_layer_and_gathers_no_experts_or_tokens_over_expert(ep_step):
  """The scan's forward body holds the layer's two all-to-alls, its backward body their two transposes.

  All-gathers over `expert` are of non-expert weights (their embed dimension splits over fsdp x expert); an
  expert weight (a dimension F) is gathered over fsdp alone, and no activation of tokens [B, T, D] is gathered.
  (The embedding lookup's all-gather of token ids and all-to-all, outside the layers, are FSDP's with or without
  experts: its table's embed dimension splits over fsdp x expert.)
  """
  mesh, hlo, _, _ = ep_step
  a2a = [line for line in hlo.splitlines() if " all-to-all(" in line and "/while/body/" in line]
  forward = [line for line in a2a if "transpose(jvp())" not in line]
  assert len(forward) == 2 and len(a2a) == 4, a2a
  assert all(_over_expert(line, mesh) for line in a2a)
  gathers = [line for line in hlo.splitlines() if " all-gather(" in line and _over_expert(line, mesh)]
  assert gathers  # the attention weights' FSDP gathers
  for line in gathers:
    shape = [int(d) for d in re.search(r"= \w+\[([\d,]*)\]", line).group(1).split(",") if d]
    assert F not in shape and not {T, CFG.d_model} <= set(shape), line


def _sequence_batch(seed):
  tokens = jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab_size)
  return {"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(T), (B, T)),
          "segment_ids": jnp.ones((B, T), jnp.int32), "loss_mask": jnp.ones((B, T), jnp.int32)}


@pytest.fixture(scope="module")
def lowered_capacity():
  """A 2-layer MoE decoder at capacity factor 1 (C = 2 of a device's 10 copies) on data2_expert4: (mesh, cfg,
  params placed, a batch placed, its token_stats and trace)."""
  cfg = dataclasses.replace(CFG, moe_impl="expert_parallel", moe_capacity_factor=1.0)
  mesh = _mesh("data2_expert4")
  params = init_params(cfg, jax.random.key(6))
  params = jax.device_put(params, sharding.named_shardings(jax.tree.map(lambda s: s.logical_axes, param_specs(cfg)),
                                                           params, mesh))
  batch = jax.device_put(_sequence_batch(7), sharding.batch_sharding(mesh))
  with jax.set_mesh(mesh):
    stats, trace = jax.jit(lambda p, b: token_stats(p, b["tokens"], cfg, positions=b["positions"],
                                                    segment_ids=b["segment_ids"]))(params, batch)
  return mesh, cfg, params, batch, stats, trace


def test_a_forward_reports_each_token_any_of_whose_copies_a_layer_dropped(lowered_capacity):
  *_, trace = lowered_capacity
  C = expert_parallel.capacity(T, 2, 8, 1.0)
  routes = np.asarray(trace.routes)  # [B, T, L, k]: each layer's experts, which the drops follow
  want = np.any([_dropped_copies(routes[:, :, layer], 8, C).any(axis=-1) for layer in range(CFG.n_layers)], axis=0)
  assert 0 < want.sum() < want.size
  np.testing.assert_array_equal(np.asarray(trace.dropped), want)
  assert forward_trace(dataclasses.replace(CFG, moe_impl="expert_parallel")).dropped is None  # dropless: nothing


def forward_trace(cfg):
  """The MoE trace of an unsharded 2-layer forward of `cfg`."""
  params = init_params(cfg, jax.random.key(6))
  return hidden_states(params, _sequence_batch(7)["tokens"], cfg)[1]


def test_undropped_removes_the_predictions_of_a_position_that_dropped_a_copy():
  dropped = np.zeros((2, 4), bool)
  dropped[0, 1] = dropped[1, 3] = True  # the last position predicts no token of the batch
  trace = moe.Trace({}, None, jnp.asarray(dropped))
  got = moe.undropped(jnp.ones((2, 4)), trace)  # index t: token t, predicted at t - 1
  np.testing.assert_array_equal(got, [[1, 1, 0, 1], [1, 1, 1, 1]])
  np.testing.assert_array_equal(moe.undropped(jnp.ones((2, 3)), trace), [[1, 0, 1], [1, 1, 1]])  # SFT's T - 1
  mask = jnp.ones((2, 4))
  assert moe.undropped(mask, moe.Trace({}, None)) is mask


def test_sft_and_grpo_losses_train_on_none_of_the_predictions_of_dropping_positions(lowered_capacity):
  mesh, cfg, params, batch, stats, trace = lowered_capacity
  kept = ~np.pad(np.asarray(trace.dropped)[:, :-1], ((0, 0), (1, 0)))  # token t's prediction kept: index as stats
  targets = kept[:, 1:]
  log_probs = np.asarray(stats.log_probs)
  with jax.set_mesh(mesh):
    value, metrics = jax.jit(lambda p, b: sft.loss(p, b, None, model=cfg))(params, batch)
  assert metrics["weight"] == targets.sum() < targets.size
  np.testing.assert_allclose(value, -(log_probs[:, 1:] * targets).sum() / targets.sum(), rtol=1e-5)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0)
  rl = {**batch, "loss_mask": batch["loss_mask"].at[:, 0].set(0), "advantages": jnp.linspace(-1, 1, B),
        "old_logps": jnp.asarray(log_probs)}
  rl.update(grpo.aggregation_inputs(rl["loss_mask"], grpo_cfg))
  with jax.set_mesh(mesh):
    _, metrics = jax.jit(lambda p, b: grpo.loss(p, b, None, model=cfg, grpo=grpo_cfg))(params, rl)
  np.testing.assert_allclose(metrics["weight"], (np.asarray(rl["agg_weights"]) * kept).sum(), rtol=1e-6)
  assert metrics["weight"] < np.asarray(rl["agg_weights"]).sum()


def test_kv_cache_forwards_run_dropless_whatever_the_capacity(lowered_capacity):
  """What every sampler decodes through: a lowered capacity must not change a sampled token's logits."""
  mesh, cfg, params, batch, _, _ = lowered_capacity
  dropless = dataclasses.replace(cfg, moe_capacity_factor=None)

  def prefill(cfg):
    cache = init_cache(cfg, B, T)
    return hidden_with_cache(params, batch["tokens"], cfg, cache, positions=batch["positions"])

  with jax.set_mesh(mesh):
    (x, _, trace), (want, _, _) = jax.jit(prefill, static_argnums=0)(cfg), jax.jit(prefill, static_argnums=0)(dropless)
  np.testing.assert_array_equal(x, want)
  assert trace.dropped is None


def test_dpo_refuses_a_capacity_that_drops_copies(lowered_capacity):
  mesh, cfg, params, batch, _, _ = lowered_capacity
  with pytest.raises(ConfigError, match="model.moe_capacity_factor=1.0 drops token copies.*DPO"):
    dpo.loss(params, {"chosen": batch, "rejected": batch}, None, model=cfg, dpo=DPOConfig(loss_type="simpo"))
  with pytest.raises(ConfigError, match="model.moe_capacity_factor=1.0"):
    config_rules.check(Config(model=cfg, data=dataclasses.replace(Config().data, kind="preference", pack=False)), "dpo")


def _collectives_by_loop(hlo: str) -> list[tuple[bool, str, tuple[int, ...]]]:
  """Each collective of a compiled program: (inside a while loop's body, its op, its result shape)."""
  bodies, found, computation = set(re.findall(r"body=%?([\w.\-]+)", hlo)), [], None
  for line in hlo.splitlines():
    if (m := re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)) and line.rstrip().endswith("{"):
      computation = m.group(1)
    op = re.search(r" (all-gather|all-to-all|all-reduce)\(", line)
    if op:  # the result's shape: a tuple's first
      shape = re.search(r"= \(?\w+\[([\d,]*)\]", line).group(1)
      found.append((computation in bodies, op.group(1), tuple(int(d) for d in shape.split(",") if d)))
  return found


def test_decoding_moves_tokens_to_the_experts_and_gathers_no_expert_weight_per_step():
  """generate_padded on fsdp2_expert4: the expert weights' fsdp gathers run once, before the decode loop; each step
  sends its tokens to the experts and back (two all-to-alls per MoE layer), and gathers no expert weight."""
  cfg = dataclasses.replace(CFG, moe_impl="expert_parallel")
  mesh = _mesh("fsdp2_expert4")
  params = init_params(cfg, jax.random.key(8))
  params = jax.device_put(params, sharding.named_shardings(jax.tree.map(lambda s: s.logical_axes, param_specs(cfg)),
                                                           params, mesh))
  prompts = jax.device_put(jnp.ones((B, 4), jnp.int32), sharding.batch_sharding(mesh))
  lengths, stops = jnp.full((B,), 4, jnp.int32), jnp.full((B, 1), 1, jnp.int32)
  sample = jax.jit(lambda p, prompts: generate_padded(p, prompts, lengths, stops, jax.random.key(9), 6, cfg=cfg,
                                                      sampling=SamplingConfig(), budget=6))
  with jax.set_mesh(mesh):
    found = _collectives_by_loop(sample.lower(params, prompts).compile().as_text())
  expert_gathers = [(in_loop, shape) for in_loop, op, shape in found if op == "all-gather" and F in shape]
  assert expert_gathers and not any(in_loop for in_loop, _ in expert_gathers), expert_gathers
  in_loop = [(op, shape) for looped, op, shape in found if looped]
  dispatches = [shape for op, shape in in_loop if op == "all-to-all" and CFG.d_model in shape]
  assert len(dispatches) == 2 * CFG.n_layers, in_loop
  assert not [shape for op, shape in in_loop if op == "all-gather" and CFG.d_model in shape], in_loop
