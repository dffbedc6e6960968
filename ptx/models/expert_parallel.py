"""Expert parallelism: an MoE layer's experts split over the `expert` mesh axis, token copies sent by all-to-all.

`ModelConfig.moe_impl = "expert_parallel"` (`ptx.models.moe` dispatches here).
The expert weights [E, D, F] split their `experts` dimension over the mesh
axes of the `experts` parameter rule (`expert` by default; `ptx.sharding`), EP
devices holding E_local = E / EP experts each, the device of index j experts
j E_local to (j + 1) E_local - 1. Under `jax.shard_map` each device, on its own
tokens (N of them, split over the batch and sequence axes as everywhere):

  1. places each token copy (token n, its i-th expert e) in e's queue, in
     token order: place = the copies of e before it; a copy whose place is at
     least the capacity C is dropped;
  2. packs the kept copies into a send buffer [EP, E_local, C, D] (slot e C +
     place; empty slots are zeros), by a gather from the tokens;
  3. `all_to_all` over the EP axes: device j receives every device's copies
     for its own experts, [EP sources, E_local, C, D];
  4. runs its experts' gated MLPs on them (batched einsums over E_local; the
     hidden units split over `tensor` as the dense MLP's are; expert biases,
     with `moe.expert_bias`, added per slot, the down projection's on the
     first `tensor` slice only, so that step 6's sum adds it once);
  5. `all_to_all` back, so each device holds its own copies' outputs;
  6. gathers each copy's output from its slot (a dropped copy's is zero) and
     sums a token's k outputs weighted by its gate weights, in float32; with
     hidden units split over `tensor`, the partial sums are summed over it.

Two all-to-alls per layer forward (and two in its backward: each is the
other's transpose); no expert weight moves over the EP axes and no token
crosses the data, fsdp or seq axes. Weights whose `embed` dimension the
parameter rules split (over `fsdp`) are gathered over those axes before the
`shard_map`, as for any FSDP weight. Where the batch cannot split over the EP
axes, each of their devices holds and routes the same tokens (the work
repeated, the result the same); where the experts cannot (E not a multiple
of EP), every device holds every expert and no all-to-all runs.

Capacity. A token's k experts are distinct (a top-k), so an expert receives at
most one copy of each token: with `ModelConfig.moe_capacity_factor = None`,
C = N and no copy is ever dropped: the layer equals the dense reference up to
rounding, at a buffer of E x N rows per device (E / k times the copies). A
factor c gives C = min(N, ceil(c N k / E)) (the GShard capacity: c = 1 is room
for a perfectly balanced load) and drops the copies of a busy expert past C,
later tokens first. Which copies drop depends on the other tokens of the
device's batch, so a lowered capacity would break sampler = trainer: `experts`
returns each token's dropped copies, the layer logs their fraction over the
real tokens as the statistic `tokens_dropped` (0 at the default), and a
forward reports the tokens (`moe.Trace.dropped`), whose predictions the SFT
and GRPO losses leave out (`moe.undropped`; DPO refuses a lowered capacity).
Forwards against a KV cache, which every sampler decodes through, always run
dropless (`decoder.hidden_with_cache`).

The dropless form, a `jax.lax.ragged_all_to_all` of exactly the routed copies
(MaxText, Tunix), does not compile on XLA:CPU (its ThunkEmitter has no
ragged-all-to-all), so nothing here could test it: it is not built.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ptx import sharding
from ptx.models.gated_mlp import Activation, gated_activation, summed_once

Params = dict[str, Any]
MeshAxes = str | tuple[str, ...] | None


def experts(h: jax.Array, routes: tuple[jax.Array, jax.Array], w: Params, activation: Activation,
            capacity_factor: float | None, rules: sharding.Rules) -> tuple[jax.Array, jax.Array]:
  """The routed experts on tokens h [B, T, D], run where their weights live (module docstring).

  Args:
    h: the normed residual stream [B, T, D] in the compute dtype.
    routes: each token's experts, int32 [B, T, k], and gate weights, float32 [B, T, k] (`moe.Routes`).
    w: expert_gate, expert_up [E, D, F] and expert_down [E, F, D] in the compute dtype (and, with
      `moe.expert_bias`, expert_gate_bias, expert_up_bias [E, F] and expert_down_bias [E, D]).
    activation: the gated MLP's activation (`ptx.models.gated_mlp`).
    capacity_factor: `ModelConfig.moe_capacity_factor` (None: no copy dropped).
    rules: the sharding rules: the parameter rules name the EP axes (`experts`) and those of the experts' hidden
      units (`mlp`), the activation rules the token axes.

  Returns:
    (the experts' weighted sum, float32 [B, T, D]; how many of each token's k copies were dropped, int32 [B, T]).
  """
  ids, weights = routes
  local = functools.partial(_local, activation=activation, capacity_factor=capacity_factor)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(h, ids, weights, w, ep_axes=None, tensor_axes=None)
  ep_axes, _, tensor_axes = sharding.logical_to_spec(("experts", None, "mlp"), rules, kind="params",
                                                     shape=w["expert_gate"].shape, mesh=mesh)
  tokens = sharding.logical_to_spec(("batch", "seq", None), rules, shape=h.shape, mesh=mesh)
  w_specs = {"expert_gate": PartitionSpec(ep_axes, None, tensor_axes),
             "expert_up": PartitionSpec(ep_axes, None, tensor_axes),
             "expert_down": PartitionSpec(ep_axes, tensor_axes, None),
             "expert_gate_bias": PartitionSpec(ep_axes, tensor_axes),
             "expert_up_bias": PartitionSpec(ep_axes, tensor_axes),
             "expert_down_bias": PartitionSpec(ep_axes, None)}
  w_specs = {name: spec for name, spec in w_specs.items() if name in w}
  split = {axis for axes in tokens for axis in sharding.as_tuple(axes)}
  unsplit = tuple(axis for axis in sharding.as_tuple(ep_axes) if axis not in split)

  def body(h, ids, weights, w):
    y, dropped = local(h, ids, weights, w, ep_axes=ep_axes, tensor_axes=tensor_axes)
    if not unsplit:
      return y, dropped
    # A batch too small to split over the EP axes is whole on each of their devices, which all compute the same
    # result; shard_map's out_specs need a value it knows to be equal along those axes: their mean (one all-reduce).
    return jax.lax.pmean(y, unsplit), jax.lax.pmax(dropped, unsplit)

  return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, w_specs),
                       out_specs=(tokens, PartitionSpec(*tokens[:2])))(h, ids, weights, w)


def dropped_fraction(dropped: jax.Array, token_mask: jax.Array, k: int) -> jax.Array:
  """The fraction of the token copies of `token_mask`'s tokens that were dropped: float32, 0 when none were.

  Args:
    dropped: each token's dropped copies, int32 [B, T] (`experts`).
    token_mask: bool [B, T], the tokens counted (padding excluded).
    k: copies per token (experts per token).
  """
  mask = token_mask.astype(jnp.float32)
  return jnp.sum(mask * dropped) / (k * jnp.maximum(jnp.sum(mask), 1.0))


def capacity(tokens: int, k: int, n_experts: int, capacity_factor: float | None) -> int:
  """Copies one device sends one expert at most: all its tokens by default, else the GShard capacity (docstring)."""
  if capacity_factor is None:
    return tokens
  return max(1, min(tokens, math.ceil(capacity_factor * tokens * k / n_experts)))


def _local(h: jax.Array, ids: jax.Array, weights: jax.Array, w: Params, *, activation: Activation,
           capacity_factor: float | None, ep_axes: MeshAxes, tensor_axes: MeshAxes) -> tuple[jax.Array, jax.Array]:
  """Steps 1-6 of the module docstring on one device's tokens h [b, t, D]: ([b, t, D] float32, dropped [b, t])."""
  b, t, D = h.shape
  N, k = b * t, ids.shape[-1]
  ep = 1 if ep_axes is None else jax.lax.axis_size(ep_axes)
  E_local = w["expert_gate"].shape[0]
  E = ep * E_local
  C = capacity(N, k, E, capacity_factor)
  flat = ids.reshape(N * k)  # copy i is token i // k's (i % k)-th expert
  earlier = jnp.cumsum(jax.nn.one_hot(flat, E, dtype=jnp.int32), axis=0)  # [N k, E], copies so far per expert
  place = jnp.take_along_axis(earlier, flat[:, None], axis=1)[:, 0] - 1
  kept = place < C
  slot = jnp.where(kept, flat * C + place, E * C)  # E C: past the buffer, where a gather reads zeros
  # The token whose copy fills each slot (N, past the tokens, for an empty one): integers, no gradient.
  source = jnp.full((E * C,), N, jnp.int32).at[slot].set(jnp.arange(N * k, dtype=jnp.int32) // k, mode="drop")
  send = jnp.take(h.reshape(N, D), source, axis=0, mode="fill", fill_value=0).reshape(ep, E_local, C, D)
  received = send if ep_axes is None else jax.lax.all_to_all(send, ep_axes, 0, 0)  # [EP sources, E_local, C, D]

  def per_slot(bias: str, summed_over: MeshAxes = None) -> jax.Array | int:
    """Each slot's row of its expert's bias [E_local, X], as [1, E_local, 1, X] (0 without biases)."""
    return summed_once(w[bias], summed_over)[None, :, None, :] if bias in w else 0

  gate = jnp.einsum("secd,edf->secf", received, w["expert_gate"]) + per_slot("expert_gate_bias")
  up = jnp.einsum("secd,edf->secf", received, w["expert_up"]) + per_slot("expert_up_bias")
  out = jnp.einsum("secf,efd->secd", gated_activation(activation, gate, up), w["expert_down"])
  out = out + per_slot("expert_down_bias", tensor_axes)
  back = out if ep_axes is None else jax.lax.all_to_all(out, ep_axes, 0, 0)  # [EP owners, E_local, C, D]
  copies = jnp.take(back.reshape(E * C, D), slot, axis=0, mode="fill", fill_value=0).reshape(b, t, k, D)
  y = jnp.einsum("btkd,btk->btd", copies.astype(jnp.float32), weights)
  if tensor_axes is not None:
    y = jax.lax.psum(y, tensor_axes)
  return y, jnp.sum(~kept.reshape(b, t, k), axis=-1, dtype=jnp.int32)
