"""Projections as 2-D matrix multiplies.

`dense("btd,dhk->bthk", x, w)` is `einsum` with the leading (batch) axes of
x and the trailing axes of w each folded into one (free reshapes of
row-major arrays), so the forward and both gradients are plain 2-D GEMMs,
the form every backend's dot is fastest at; XLA:CPU in particular runs an
einsum whose gradient contracts two axes (b and t) as transposes plus a
generic dot.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import qwix


def dense(eq: str, x: jax.Array, w: jax.Array, *, preferred_element_type: Any = None) -> jax.Array:
  """`einsum(eq, x, w)` for a projection whose contracted letters lead w and trail x.

  Args:
    eq: e.g. "btd,dhk->bthk" or "bthk,hkd->btd": x is (batch..., contracted...),
      w is (contracted..., out...), the output is (batch..., out...).
    x: activations.
    w: the weight, or its int8 `qwix.QArray` (`ptx.models.int8_weights`), read weight-only.
    preferred_element_type: accumulation/output dtype (e.g. float32 logits).

  Raises:
    ValueError: when `eq` does not have that form.
  """
  inputs, out = eq.split("->")
  x_sub, w_sub = inputs.split(",")
  n_contract = sum(c in x_sub for c in w_sub)
  batch, contracted, outputs = x_sub[:-n_contract], x_sub[-n_contract:], w_sub[n_contract:]
  if w_sub[:n_contract] != contracted or out != batch + outputs:
    raise ValueError(f"dense: {eq!r} is not of the form 'batch contracted, contracted out -> batch out'")
  n_batch = len(batch)
  quantized = isinstance(w, qwix.QArray)
  if _folding_gathers(x.shape[:n_batch]):
    # Folding [B, T] into one row axis when the sequence axis T is split over devices and B > 1 is no free
    # reshape: each device's rows are not one block of the folded axis, so GSPMD gathers the sequence first
    # (18 of a (data 2, seq 4) GRPO step's 22 all-gathers; on (seq 8) with two rows, whole [tokens, vocab]
    # logit chunks per device). Contract in place instead. With one row the fold is free, and XLA:CPU's
    # unfolded dot held more (a 1M-token seq-8 SFT step: 5.3 GiB per device against 4.4).
    dot_general = qwix.dot_general if quantized else jax.lax.dot_general
    return dot_general(x, w, ((tuple(range(n_batch, x.ndim)), tuple(range(n_contract))), ((), ())),
                       preferred_element_type=preferred_element_type)
  x2 = x.reshape(math.prod(x.shape[:n_batch]), -1)
  # Sizes spelled out: a QArray reshapes its qvalue and scale by groups of axes and takes no -1.
  w2 = w.reshape(math.prod(w.shape[:n_contract]), math.prod(w.shape[n_contract:]))
  if quantized:
    y = qwix.dot_general(x2, w2, (((1,), (0,)), ((), ())), preferred_element_type=preferred_element_type)
  else:
    y = jnp.dot(x2, w2, preferred_element_type=preferred_element_type)
  return y.reshape(*x.shape[:n_batch], *w.shape[n_contract:])


def _folding_gathers(batch_shape: tuple[int, ...]) -> bool:
  """Whether folding leading axes `batch_shape` (B, T, ...) into one would move the mesh's split `seq` axis.

  The activation rules put the sequence (axis 1) on the mesh's `seq` axis; folding keeps every device's slice
  one block of the folded axis only while the axes before it have one element.
  """
  mesh = jax.sharding.get_abstract_mesh()
  split = not mesh.empty and "seq" in mesh.axis_names and mesh.shape["seq"] > 1
  return split and len(batch_shape) > 1 and batch_shape[1] > 1 and batch_shape[0] > 1
