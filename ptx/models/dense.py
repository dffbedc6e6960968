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


def dense(eq: str, x: jax.Array, w: jax.Array, *, preferred_element_type: Any = None) -> jax.Array:
  """`einsum(eq, x, w)` for a projection whose contracted letters lead w and trail x.

  Args:
    eq: e.g. "btd,dhk->bthk" or "bthk,hkd->btd": x is (batch..., contracted...),
      w is (contracted..., out...), the output is (batch..., out...).
    x: activations.
    w: the weight.
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
  if _rows_and_sequence_sharded():
    # Folding a batch axis and a sequence axis that are both sharded into one row axis makes GSPMD gather the
    # sequence first (18 of a (data 2, seq 4) GRPO step's 22 all-gathers): contract in place instead. With
    # only one of them sharded the fold is free, and XLA:CPU's unfolded dot held more (a 1M-token seq-8 SFT
    # step: 5.3 GiB per device against 4.4).
    return jax.lax.dot_general(x, w, ((tuple(range(n_batch, x.ndim)), tuple(range(n_contract))), ((), ())),
                               preferred_element_type=preferred_element_type)
  x2 = x.reshape(math.prod(x.shape[:n_batch]), -1)
  w2 = w.reshape(math.prod(w.shape[:n_contract]), -1)
  y = jnp.dot(x2, w2, preferred_element_type=preferred_element_type)
  return y.reshape(*x.shape[:n_batch], *w.shape[n_contract:])


def _rows_and_sequence_sharded() -> bool:
  """Whether the current mesh splits the sequence (`seq`) and the batch (`data` or `fsdp`) both over > 1 device."""
  mesh = jax.sharding.get_abstract_mesh()
  size = lambda name: mesh.shape[name] if name in mesh.axis_names else 1  # noqa: E731
  return not mesh.empty and size("seq") > 1 and size("data") * size("fsdp") > 1
