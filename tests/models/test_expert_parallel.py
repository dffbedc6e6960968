"""Expert parallelism: the all-to-all MoE layer against the dense reference, its collectives, its capacity."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptx import sharding
from ptx.config import MeshConfig
from ptx.model_config import ModelConfig, MoeConfig
from ptx.models import expert_parallel, init_params, moe
from ptx.models.decoder import forward
from ptx.models.params import param_specs

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


def _layer(seed=0):
  """One MoE layer's parameters, perturbed so that the router bias matters and the experts differ."""
  layer = jax.tree.map(lambda w: w[0], init_params(CFG, jax.random.key(seed))["layers"])
  layer = {name: layer[name] for name in ("router", "router_bias", "expert_gate", "expert_up", "expert_down")}
  keys = jax.random.split(jax.random.key(seed + 1), len(layer))
  return {name: w + 0.3 * jax.random.normal(key, w.shape) for (name, w), key in zip(sorted(layer.items()), keys)}


def _placed(p, h, mesh):
  axes = {name: spec.logical_axes[1:] for name, spec in param_specs(CFG)["layers"].items() if name in p}
  tokens = sharding.named_shardings(("batch", "seq", None), h, mesh, kind="activations")
  return jax.device_put(p, sharding.named_shardings(axes, p, mesh)), jax.device_put(h, tokens)


def _mlp(p, h, impl, capacity_factor=None):
  cfg = dataclasses.replace(CFG, moe_impl=impl, moe_capacity_factor=capacity_factor)
  return moe.moe_mlp(p, h, cfg, token_mask=jnp.ones(h.shape[:2], bool), rules=sharding.DEFAULT_RULES)


def _value_and_grad(impl):
  return jax.jit(jax.value_and_grad(lambda p, h: jnp.sum(jnp.sin(_mlp(p, h, impl)[0])), argnums=(0, 1)))


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
  want = moe._dense_experts(h, moe.Routes(routes.ids, routes.weights * ~dropped), p, CFG.activation)
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
