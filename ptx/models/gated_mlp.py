"""The gated MLP, `down(act(x gate) * (x up))`: SwiGLU or GeGLU, the dense layers' MLP and the shared experts'."""

from __future__ import annotations

import functools
from typing import Any

import jax

from ptx import sharding
from ptx.models import lora

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated_activation(activation: str, gate: jax.Array, up: jax.Array) -> jax.Array:
  """`act(gate) * up` (SwiGLU, GeGLU), differentiated from gate and up alone.

  Autodiff keeps act(gate) and its intermediates (SiLU's sigmoid) as
  hidden-sized residuals, each written in the forward and read back in the
  backward. Recomputing them inside the backward's one elementwise pass is
  cheaper on any backend: only gate and up stay as residuals.
  """
  return _ACTIVATIONS[activation](gate) * up


def _gated_activation_fwd(activation: str, gate: jax.Array, up: jax.Array):
  return gated_activation(activation, gate, up), (gate, up)


def _gated_activation_bwd(activation: str, residuals, d_hidden: jax.Array):
  gate, up = residuals
  act, act_vjp = jax.vjp(_ACTIVATIONS[activation], gate)
  return act_vjp(d_hidden * up)[0], d_hidden * act


gated_activation.defvjp(_gated_activation_fwd, _gated_activation_bwd)


def gated_mlp(p: dict[str, Any], h: jax.Array, activation: str, dtype: Any, rules: sharding.Rules) -> jax.Array:
  """The MLP of one layer's `gate` [D, F], `up` [D, F] and `down` [F, D] (or their LoRA weights) on h [B, T, D]."""
  hidden = gated_activation(activation, lora.project("btd,df->btf", h, p["gate"], dtype),
                            lora.project("btd,df->btf", h, p["up"], dtype))
  hidden = sharding.constrain(hidden, ("batch", "seq", "mlp"), rules)
  return lora.project("btf,fd->btd", hidden, p["down"], dtype)
