"""Mixture-of-Experts MLPs: a router sends each token to k of E experts and sums their gated MLPs, weighted.

One MoE layer's parameters (`ptx.models.params`; E experts, D d_model, F `moe.expert_mlp_dim`):
  router [D, E] (+ router_bias [E] with `moe.router_bias`, router_correction [E] with the sigmoid router);
  expert_gate, expert_up [E, D, F]; expert_down [E, F, D]
  (+ expert_gate_bias, expert_up_bias [E, F] and expert_down_bias [E, D] with `moe.expert_bias`: each copy of a
  token adds its expert's row, in every implementation's layout)
and, with shared experts (`moe.shared_mlp_dim`), the dense MLP's gate, up and down, run on every token.

Routing (`route`) from the E float32 router logits, by `moe.router`:
  softmax  the k largest probabilities of a softmax (Qwen3-MoE; Mixtral's and gpt-oss's top-k-then-softmax
           is the same function);
  sigmoid  sigmoid scores; the k experts of the largest scores plus the correction bias, among the experts of
           the `moe.topk_groups` groups whose two best biased scores sum highest (DeepSeek-V3, Kimi K2); the
           gate weights are the unbiased scores.
Either way the weights are divided by their sum when `moe.norm_topk_prob`, then scaled by `moe.routed_scale`.

Implementations (`ModelConfig.moe_impl`), equal up to float rounding (and dropless at expert_parallel's default):
  dense   every expert on every token, weighted by the gate weights (zero off a token's route): the
          reference, and the fastest on a CPU, where a grouped matmul computes densely anyway (k times
          dense's FLOPs).
  ragged  each token copied k times, the copies sorted by expert and run through one grouped matmul per
          projection (`jax.lax.ragged_dot`); under a mesh, on each device over its own tokens (`shard_map`),
          so that sorting never moves tokens between devices.
  expert_parallel  experts split over the `expert` mesh axis, each device's token copies sent to them and back
          by two all-to-alls, at most C per expert (`model.moe_capacity_factor`; None: dropless), drops counted
          as `tokens_dropped`, the tokens reported in the forward's `Trace.dropped` and their predictions
          left out of the losses (`undropped`); KV-cache forwards, the samplers', never drop
          (`ptx.models.expert_parallel`).

Routing replay (`moe_mlp`'s `replay`): experts recorded for the tokens (the sampler's, `Generation.routes`, or
an earlier forward's) are used instead of the router's choice, their gate weights read from the live router's full
scores (`gate_weights`), so the router keeps learning; `moe_mlp` returns the experts it used either way, which a
forward reports in its `Trace`.

Statistics per layer (`moe_mlp`'s second result, float32 scalars over the tokens of `token_mask`): the load
of the busiest expert over the mean load, the router's mean entropy, Switch's load-balancing loss
E * sum_e f_e P_e (1 when balanced; f_e the fraction of token copies routed to e, P_e its mean probability)
and the router z-loss mean(logsumexp(logits)^2); under replay, `route_flips`, the fraction of the replayed experts
of the recorded tokens that the router's own top-k leaves out.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from ptx_kernels import xla_cpu_workarounds

from ptx import sharding
from ptx.model_config import ModelConfig, MoeConfig
from ptx.models import expert_parallel
from ptx.models.dense import dense
from ptx.models.gated_mlp import Activation, activation_of, gated_activation, summed_once

Params = dict[str, Any]
# Statistic name -> float32 value: one layer's scalars, or [L] stacked over a model's layers (empty when dense).
LayerStats = dict[str, jax.Array]


# Recorded routes: expert ids (E <= 32,767) in int16, NO_ROUTE where a token has none (padding, or a column the
# sampler never fed back), never expert 0.
ROUTE_DTYPE = jnp.int16
NO_ROUTE = -1


def no_routes(rows: int, columns: int, cfg: ModelConfig) -> jax.Array:
  """NO_ROUTE routes [rows, columns, L, k] of `cfg`'s MoE layers: a buffer before a forward or a sampler fills it."""
  return jnp.full((rows, columns, cfg.n_moe_layers, cfg.moe.experts_per_token), NO_ROUTE, ROUTE_DTYPE)


class Trace(NamedTuple):
  """What a forward's MoE layers report: their statistics, the experts they chose and the tokens they dropped."""

  stats: LayerStats  # name -> float32 [L] over the MoE layers; empty for a dense model
  routes: jax.Array | None  # ROUTE_DTYPE [B, T, L, k]: MoE layer l's experts of token (b, t); None when dense
  # bool [B, T]: a token some MoE layer dropped a copy of (expert_parallel at a lowered capacity); None where no
  # layer can drop one (dense, or dropless by construction).
  dropped: jax.Array | None = None


class Routes(NamedTuple):
  """Each token's experts and their gate weights."""

  ids: jax.Array  # int32 [B, T, k]
  weights: jax.Array  # float32 [B, T, k]


# A layer's routed-expert parameters, in the compute dtype inside the layer (the biases with `moe.expert_bias`).
EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down", "expert_gate_bias", "expert_up_bias", "expert_down_bias")


def resolve_impl(impl: str) -> str:
  """The implementation `ModelConfig.moe_impl` names here.

  "auto" is expert_parallel under a mesh whose `expert` axis is over 1, else dense in CPU programs (an XLA:CPU
  workaround, `ptx_kernels.xla_cpu_workarounds`: off, as for a pod's programs compiled on CPU, it is ragged) and
  ragged elsewhere.

  Raises:
    ValueError: naming model.moe_impl, for an unknown name.
  """
  if impl == "auto":
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and dict(mesh.shape).get("expert", 1) > 1:
      return "expert_parallel"
    return "dense" if xla_cpu_workarounds.active() else "ragged"
  if impl not in ("dense", "ragged", "expert_parallel"):
    raise ValueError(f"model.moe_impl must be 'auto', 'dense', 'ragged' or 'expert_parallel', got {impl!r}")
  return impl


def router_logits(p: Params, h: jax.Array) -> jax.Array:
  """Float32 router logits [B, T, E] of tokens h [B, T, D]: routes decided in float32 whatever the compute dtype."""
  logits = dense("btd,de->bte", h.astype(jnp.float32), p["router"].astype(jnp.float32))
  if "router_bias" in p:
    logits = logits + p["router_bias"].astype(jnp.float32)[None, None]
  return logits


def choose(logits: jax.Array, moe: MoeConfig, correction: jax.Array | None = None) -> jax.Array:
  """The k experts of each token, int32 [B, T, k], from float32 router logits [B, T, E] (module docstring).

  Args:
    logits: float32 router logits [B, T, E].
    moe: the routing rule.
    correction: the sigmoid router's selection bias [E] (`router_correction`); None for softmax.
  """
  k = moe.experts_per_token
  if moe.router == "softmax":
    # Of the probabilities, as transformers picks them: logits whose softmax rounds to a tie rank as it does.
    return jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)[1].astype(jnp.int32)
  choice = jax.nn.sigmoid(logits) + correction.astype(jnp.float32).reshape((1,) * (logits.ndim - 1) + (-1,))
  if moe.n_groups > 1:
    grouped = choice.reshape(*choice.shape[:-1], moe.n_groups, -1)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best = jax.lax.top_k(group_scores, moe.topk_groups)
    kept = jnp.sum(jax.nn.one_hot(best, moe.n_groups, dtype=jnp.bool_), axis=-2, dtype=jnp.bool_)
    choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)  # the other groups' experts
  return jax.lax.top_k(choice, k)[1].astype(jnp.int32)


def gate_weights(logits: jax.Array, ids: jax.Array, moe: MoeConfig) -> jax.Array:
  """The gate weights float32 [B, T, k] of experts `ids` [B, T, k], read from the full softmax or sigmoid scores.

  Read from every expert's score, never from top-k-zeroed ones, so that a
  replayed expert the live router would not pick still gets its weight and
  its gradient.
  """
  scores = jax.nn.softmax(logits, axis=-1) if moe.router == "softmax" else jax.nn.sigmoid(logits)
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if moe.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (1e-20 if moe.router == "sigmoid" else 0.0))
  return weights * moe.routed_scale


def route(logits: jax.Array, moe: MoeConfig, correction: jax.Array | None = None) -> Routes:
  """Each token's experts (`choose`) and their gate weights (`gate_weights`) from float32 logits [B, T, E]."""
  ids = choose(jax.lax.stop_gradient(logits), moe, correction)
  return Routes(ids, gate_weights(logits, ids, moe))


def router_probs(logits: jax.Array, moe: MoeConfig) -> jax.Array:
  """Each token's distribution over the experts [B, T, E]: the softmax, or the sigmoid scores normalised."""
  if moe.router == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  scores = jax.nn.sigmoid(logits)
  return scores / jnp.sum(scores, axis=-1, keepdims=True)


def moe_mlp(
    p: Params,
    h: jax.Array,
    cfg: ModelConfig,
    *,
    token_mask: jax.Array,
    rules: sharding.Rules,
    replay: jax.Array | None = None,
) -> tuple[jax.Array, LayerStats, jax.Array, jax.Array | None]:
  """One layer's MoE MLP on h [B, T, D] (module docstring); the shared experts are added by the caller.

  Args:
    p: one layer's parameters (router, expert_gate, expert_up, expert_down; router_bias and router_correction
      when the config has them).
    h: the normed residual stream [B, T, D] in the compute dtype.
    cfg: the model config (`cfg.moe`, `cfg.moe_impl`, `cfg.activation`).
    token_mask: bool [B, T], the tokens the statistics count (padding excluded).
    rules: the activation sharding rules.
    replay: ROUTE_DTYPE [B, T, k]: experts recorded for these tokens (routing replay), used instead of the
      router's choice wherever recorded (not NO_ROUTE); the gate weights still come from the live router.
      Adds the statistic `route_flips`. None: the router chooses.

  Returns:
    (the experts' weighted sum [B, T, D] in the compute dtype, the layer's statistics, the experts used:
    ROUTE_DTYPE [B, T, k], the tokens with a dropped copy: bool [B, T], or None where none can drop: every
    implementation but expert_parallel at a lowered `cfg.moe_capacity_factor`).
  """
  logits = router_logits(p, h)
  correction = p.get("router_correction")
  if replay is None:
    routes = _token_local(lambda lg, c: route(lg, cfg.moe, c), (logits,), replicated=correction, rules=rules)
    flips = None
  else:
    routes, flips = _token_local(lambda lg, rp, c: _replayed(lg, rp, cfg.moe, c), (logits, replay),
                                 replicated=correction, rules=rules)
  experts = {name: p[name].astype(cfg.compute_dtype) for name in EXPERT_WEIGHTS if name in p}
  activation, dropped = activation_of(cfg), None
  if resolve_impl(cfg.moe_impl) == "dense":
    y = _dense_experts(h, routes, experts, activation)
  elif resolve_impl(cfg.moe_impl) == "expert_parallel":
    y, dropped = expert_parallel.experts(h, routes, experts, activation, cfg.moe_capacity_factor, rules)
  else:
    y = _ragged_on_devices(h, routes, experts, activation, rules)
  y = sharding.constrain(y.astype(h.dtype), ("batch", "seq", "embed"), rules)
  stats = statistics(logits, routes, token_mask, cfg.moe)
  if dropped is not None:
    stats["tokens_dropped"] = expert_parallel.dropped_fraction(dropped, token_mask, cfg.moe.experts_per_token)
  if flips is not None:
    recorded = token_mask & (replay[..., 0] != NO_ROUTE)
    stats["route_flips"] = _masked_mean(jnp.mean(flips, axis=-1), recorded)
  may_drop = dropped is not None and cfg.moe_capacity_factor is not None
  return y, stats, routes.ids.astype(ROUTE_DTYPE), dropped > 0 if may_drop else None


def undropped(mask: jax.Array, trace: Trace) -> jax.Array:
  """`mask` without the predictions of positions that had a token copy dropped (`Trace.dropped`).

  A dropped copy adds nothing to its token's MLP output, so the logits at that
  position, and the log-prob of the next token, are not the policy's: a loss
  must not train on them, nor compare them with a sampler's (which never
  drops). Later tokens still attend to the position, as in GShard's and
  MaxText's dropping layers.

  Args:
    mask: [B, T'] over a forward's last T' tokens, index t scoring token t as predicted at position t - 1
      (`ptx.models.chunked_logits.TokenStats`' alignment; SFT's next-token weights are T' = T - 1).
    trace: the forward's MoE trace.

  Returns:
    `mask` with zeros where the predicting position dropped a copy; `mask` itself when no layer can drop.
  """
  if trace.dropped is None:
    return mask
  before = jnp.pad(trace.dropped[:, :-1], ((0, 0), (1, 0)))[:, trace.dropped.shape[1] - mask.shape[1]:]
  return jnp.where(before, jnp.zeros_like(mask), mask)


def _replayed(logits: jax.Array, replay: jax.Array, moe: MoeConfig,
              correction: jax.Array | None) -> tuple[Routes, jax.Array]:
  """(Routes with the recorded experts where there are some, float32 [B, T, k] 1 where the router's own choice
  leaves a recorded expert out: its flips)."""
  own = choose(jax.lax.stop_gradient(logits), moe, correction)
  recorded = replay.astype(jnp.int32)
  flips = ~jnp.any(own[..., :, None] == recorded[..., None, :], axis=-1)
  ids = jnp.where(recorded[..., :1] != NO_ROUTE, recorded, own)
  return Routes(ids, gate_weights(logits, ids, moe)), flips.astype(jnp.float32)


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """The mean of x [B, T] over the tokens of bool `mask` [B, T] (0 when none)."""
  m = mask.astype(jnp.float32)
  return jnp.sum(m * x) / jnp.maximum(jnp.sum(m), 1.0)


def statistics(logits: jax.Array, routes: Routes, token_mask: jax.Array, moe: MoeConfig) -> LayerStats:
  """The layer's load, entropy, load-balancing and z-loss statistics over the tokens of `token_mask` (docstring).

  The router's distribution is its softmax, or its sigmoid scores normalised (`router_probs`).
  """
  E, k = logits.shape[-1], routes.ids.shape[-1]
  mask = token_mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(mask), 1.0)
  counts = jnp.einsum("bt,btke->e", mask, jax.nn.one_hot(routes.ids, E, dtype=jnp.float32))
  probs = router_probs(logits, moe)
  mean_probs = jnp.einsum("bt,bte->e", mask, probs) / n
  log_probs = jnp.log(jnp.maximum(probs, 1e-30))
  return {
      "load_max_over_mean": jnp.max(counts) / jnp.maximum(jnp.mean(counts), 1e-9),
      "router_entropy": -jnp.sum(mask * jnp.sum(probs * log_probs, axis=-1)) / n,
      "balance_loss": E * jnp.sum(counts / (n * k) * mean_probs),
      "z_loss": jnp.sum(mask * jax.nn.logsumexp(logits, axis=-1) ** 2) / n,
  }


def aux_loss(stats: LayerStats, cfg: ModelConfig) -> jax.Array:
  """`moe_balance_coef` x the layers' mean load-balancing loss + `moe_z_coef` x their mean z-loss (0 when dense)."""
  if not stats:
    return jnp.zeros((), jnp.float32)
  return cfg.moe_balance_coef * jnp.mean(stats["balance_loss"]) + cfg.moe_z_coef * jnp.mean(stats["z_loss"])


def metrics(stats: LayerStats) -> dict[str, jax.Array]:
  """Training metrics of stacked statistics [L]: `moe/layerNN/<statistic>` per layer and `moe/<statistic>` means.

  Empty for a dense model.
  """
  out = {}
  for name, per_layer in stats.items():
    out[f"moe/{name}"] = jnp.mean(per_layer)
    out.update({f"moe/layer{i:02d}/{name}": per_layer[i] for i in range(per_layer.shape[0])})
  return out


def _token_local(fn, tokens: tuple[jax.Array, ...], *, replicated: Any, rules: sharding.Rules):
  """`fn(*tokens, replicated)` of a per-token function, run on each device's tokens under the mesh.

  Every array of `tokens` and of the result is [B, T, ...] of the same rank
  (3), split over the batch and sequence axes. GSPMD partitions a top-k over
  the batch by gathering it onto every device first. `replicated` (any
  pytree, or None) is whole on every device.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(*tokens, replicated)
  spec = sharding.logical_to_spec(("batch", "seq", None), rules, shape=tokens[0].shape, mesh=mesh)
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(tokens) + (PartitionSpec(),),
                       out_specs=spec)(*tokens, replicated)


def _dense_experts(h: jax.Array, routes: Routes, w: Params, activation: Activation) -> jax.Array:
  """Every expert on every token [B, T, D], combined by the gate weights (zero off the route): float32 [B, T, D]."""
  E = w["expert_gate"].shape[0]
  per_expert = lambda name: w[name][:, None, None, :] if name in w else 0  # a bias [E, X] on [E, B, T, X]
  gate = jnp.einsum("btd,edf->ebtf", h, w["expert_gate"]) + per_expert("expert_gate_bias")
  up = jnp.einsum("btd,edf->ebtf", h, w["expert_up"]) + per_expert("expert_up_bias")
  out = jnp.einsum("ebtf,efd->ebtd", gated_activation(activation, gate, up), w["expert_down"])
  out = out + per_expert("expert_down_bias")
  combine = jnp.einsum("btke,btk->bte", jax.nn.one_hot(routes.ids, E, dtype=jnp.float32), routes.weights)
  return jnp.einsum("bte,ebtd->btd", combine, out.astype(jnp.float32))


def _ragged_on_devices(h: jax.Array, routes: Routes, w: Params, activation: Activation,
                       rules: sharding.Rules) -> jax.Array:
  """`_ragged_local` on each device's tokens under the current mesh (or on all of them without one): [B, T, D].

  Tokens split over the batch and sequence axes stay where they are; the
  experts' hidden units split over `tensor` as the dense MLP's do, each device
  summing its slice's share of the output, then the shares summed over `tensor`.
  """
  ids, weights = routes
  local = functools.partial(_ragged_local, activation=activation)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(h, ids, weights, w, tensor_axis=None)
  spec = lambda names, x: sharding.logical_to_spec(names, rules, shape=x.shape, mesh=mesh)
  tokens = spec(("batch", "seq", None), h)
  hidden = spec((None, None, "mlp"), w["expert_gate"])
  w_specs = {"expert_gate": hidden, "expert_up": hidden, "expert_down": PartitionSpec(None, hidden[2], None),
             "expert_gate_bias": PartitionSpec(None, hidden[2]), "expert_up_bias": PartitionSpec(None, hidden[2]),
             "expert_down_bias": PartitionSpec()}
  w_specs = {name: spec for name, spec in w_specs.items() if name in w}
  return jax.shard_map(functools.partial(local, tensor_axis=hidden[2]), mesh=mesh,
                       in_specs=(tokens, tokens, tokens, w_specs), out_specs=tokens)(h, ids, weights, w)


def _ragged_local(h: jax.Array, ids: jax.Array, weights: jax.Array, w: Params, *, activation: Activation,
                  tensor_axis: str | tuple[str, ...] | None) -> jax.Array:
  """Sorted token copies through grouped matmuls, on one device's tokens h [B, T, D]: [B, T, D] float32.

  `tensor_axis`: the mesh axes the experts' hidden units are split over, whose partial outputs are summed.
  """
  B, T, D = h.shape
  k, E = ids.shape[-1], w["expert_gate"].shape[0]
  flat = ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  copies = _permute(jnp.repeat(h.reshape(B * T, D), k, axis=0), order, inverse)
  sizes = jnp.bincount(flat, length=E).astype(jnp.int32)

  def per_copy(bias: str, summed_over: str | tuple[str, ...] | None = None) -> jax.Array | int:
    """Each sorted copy's row of its expert's bias [E, X] (0 without biases)."""
    return jnp.take(summed_once(w[bias], summed_over), flat[order], axis=0) if bias in w else 0

  gate = jax.lax.ragged_dot(copies, w["expert_gate"], sizes) + per_copy("expert_gate_bias")
  up = jax.lax.ragged_dot(copies, w["expert_up"], sizes) + per_copy("expert_up_bias")
  out = jax.lax.ragged_dot(gated_activation(activation, gate, up), w["expert_down"], sizes)
  out = out + per_copy("expert_down_bias", tensor_axis)
  out = _permute(out, inverse, order).reshape(B, T, k, D)
  y = jnp.einsum("btkd,btk->btd", out.astype(jnp.float32), weights)
  return y if tensor_axis is None else jax.lax.psum(y, tensor_axis)


@jax.custom_vjp
def _permute(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
  """x[order] for a permutation `order` whose inverse is `inverse`.

  Its gradient is the gather g[inverse]: autodiff's would scatter-add into
  zeros, the slow form of the same thing on every backend.
  """
  return jnp.take(x, order, axis=0)


def _permute_fwd(x, order, inverse):
  return _permute(x, order, inverse), (order, inverse)


def _permute_bwd(residuals, g):
  order, inverse = residuals
  return jnp.take(g, inverse, axis=0), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)
