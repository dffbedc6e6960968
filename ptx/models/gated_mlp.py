"""The gated MLP, `down(act(x gate, x up))`: SwiGLU, GeGLU or gpt-oss's clamped SwiGLU; the dense layers' MLP, the
shared experts' and (`ptx.models.moe`) each routed expert's.

The activations (`model.activation`), each a function of the gate and up projections:
  silu            silu(gate) * up (SwiGLU: Llama, Qwen, Mixtral, DeepSeek)
  gelu_tanh       gelu_tanh(gate) * up (GeGLU: Gemma)
  clamped_swiglu  gate' * sigmoid(1.702 gate') * (up' + 1), gate' = min(gate, limit), up' = clip(up, -limit, limit),
                  limit `model.swiglu_limit` (gpt-oss)
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models import lora

# gpt-oss's sigmoid gain in clamped_swiglu (HF `swiglu_alpha`; no released checkpoint sets another).
CLAMPED_SWIGLU_ALPHA = 1.702


class Activation(NamedTuple):
  """A gated MLP's activation: `model.activation` and, for clamped_swiglu, its clamp `model.swiglu_limit`."""

  name: str
  limit: float


def activation_of(cfg: ModelConfig) -> Activation:
  """The activation of `cfg`'s MLPs."""
  return Activation(cfg.activation, cfg.swiglu_limit)


def _clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
  """gpt-oss's activation (module docstring), as transformers' `GptOssExperts._apply_gate` computes it."""
  gate = jnp.minimum(gate, limit)
  return gate * jax.nn.sigmoid(CLAMPED_SWIGLU_ALPHA * gate) * (jnp.clip(up, -limit, limit) + 1)


_ACTIVATIONS = {
    "silu": lambda gate, up, limit: jax.nn.silu(gate) * up,
    "gelu_tanh": lambda gate, up, limit: jax.nn.gelu(gate, approximate=True) * up,
    "clamped_swiglu": _clamped_swiglu,
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated_activation(activation: Activation, gate: jax.Array, up: jax.Array) -> jax.Array:
  """The hidden units `act(gate, up)` (module docstring), differentiated from gate and up alone.

  Autodiff keeps act(gate) and its intermediates (SiLU's sigmoid) as
  hidden-sized residuals, each written in the forward and read back in the
  backward. Recomputing them inside the backward's one elementwise pass is
  cheaper on any backend: only gate and up stay as residuals.
  """
  return _ACTIVATIONS[activation.name](gate, up, activation.limit)


def _gated_activation_fwd(activation: Activation, gate: jax.Array, up: jax.Array):
  return gated_activation(activation, gate, up), (gate, up)


def _gated_activation_bwd(activation: Activation, residuals, d_hidden: jax.Array):
  gate, up = residuals
  _, vjp = jax.vjp(functools.partial(_ACTIVATIONS[activation.name], limit=activation.limit), gate, up)
  return vjp(d_hidden)


gated_activation.defvjp(_gated_activation_fwd, _gated_activation_bwd)


def summed_once(bias: jax.Array, tensor_axes: str | tuple[str, ...] | None) -> jax.Array:
  """A down projection's bias on a device that holds a slice of the hidden units: whole on the first slice along
  `tensor_axes`, zero on the others, so that summing the partial outputs over those axes adds it once."""
  if tensor_axes is None:
    return bias
  return jnp.where(jax.lax.axis_index(tensor_axes) == 0, bias, jnp.zeros_like(bias))


def gated_mlp(p: dict[str, Any], h: jax.Array, activation: Activation, dtype: Any,
              rules: sharding.Rules) -> jax.Array:
  """The MLP of one layer's `gate` [D, F], `up` [D, F] and `down` [F, D] (or their LoRA weights) on h [B, T, D]."""
  hidden = gated_activation(activation, lora.project("btd,df->btf", h, p["gate"], dtype),
                            lora.project("btd,df->btf", h, p["up"], dtype))
  hidden = sharding.constrain(hidden, ("batch", "seq", "mlp"), rules)
  return lora.project("btf,fd->btd", hidden, p["down"], dtype)
