"""Tensor layouts: where each ptx parameter's axes sit in its HF tensor.

HF stores `nn.Linear` weights as [out, in] with heads flattened into one
axis; ptx keeps every logical axis separate ([D, H, K] for q). Each layout
below lists the HF tensor's axes as groups of ptx logical axes, a group being
one flattened HF axis (outermost first), so one table drives both directions:
`read_block` gathers any rectangular block of a ptx parameter from the HF
tensor (one layer at a time, only the rows it needs), and `to_hf` turns a
ptx array back into the HF tensor.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

Group = tuple[str, ...]

HF_LAYOUTS: dict[str, tuple[Group, ...]] = {
    "embed": (("vocab",), ("embed",)),
    "lm_head": (("vocab",), ("embed",)),
    "final_norm": (("embed",),),
    "attn_norm": (("embed",),),
    "mlp_norm": (("embed",),),
    "attn_post_norm": (("embed",),),
    "mlp_post_norm": (("embed",),),
    "q": (("heads", "head_dim"), ("embed",)),
    "k": (("kv_heads", "head_dim"), ("embed",)),
    "v": (("kv_heads", "head_dim"), ("embed",)),
    "o": (("embed",), ("heads", "head_dim")),
    "q_bias": (("heads", "head_dim"),),
    "k_bias": (("kv_heads", "head_dim"),),
    "v_bias": (("kv_heads", "head_dim"),),
    "q_norm": (("head_dim",),),
    "k_norm": (("head_dim",),),
    # Multi-head latent attention: a latent's rank is an unnamed (None) or `embed` axis (`ptx.models.params`).
    "q_a": ((None,), ("embed",)),
    "q_a_norm": ((None,),),
    "q_b": (("heads", "head_dim"), ("embed",)),
    "kv_a": ((None,), ("embed",)),
    "kv_a_norm": ((None,),),
    "kv_b": (("heads", "head_dim"), ("embed",)),
    "gate": (("mlp",), ("embed",)),
    "up": (("mlp",), ("embed",)),
    "down": (("embed",), ("mlp",)),
    # Mixture-of-Experts layers: the router's expert axis is unnamed (None); each expert is its own HF tensor,
    # laid out like the dense MLP's (the `experts` axis is taken off first, `ptx.models.hf_load`).
    "router": ((None,), ("embed",)),
    "router_bias": ((None,),),
    "router_correction": ((None,),),
    "expert_gate": (("mlp",), ("embed",)),
    "expert_up": (("mlp",), ("embed",)),
    "expert_down": (("embed",), ("mlp",)),
}


def per_expert(axes: tuple[str | None, ...]) -> bool:
  """Whether a parameter with these axes (without `layers`) is stored as one HF tensor per expert."""
  return bool(axes) and axes[0] == "experts"


def hf_shape(leaf: str, axes: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
  """The HF tensor shape of one layer of ptx parameter `leaf` (axes and shape without `layers`)."""
  sizes = dict(zip(axes, shape))
  return tuple(math.prod(sizes[a] for a in group) for group in HF_LAYOUTS[leaf])


def read_block(read: Callable[[tuple[slice, ...]], np.ndarray], leaf: str, axes: tuple[str, ...],
               shape: tuple[int, ...], block: tuple[slice, ...]) -> np.ndarray:
  """Reads the block `block` of one layer of a ptx parameter from its HF tensor.

  Args:
    read: reads a rectangular slice of the HF tensor (safetensors `get_slice`).
    leaf: the ptx parameter name (a key of HF_LAYOUTS).
    axes: its logical axes, without `layers`.
    shape: its shape, without `layers`.
    block: one slice per axis, with explicit start and stop.

  Returns:
    The block, in ptx axis order.
  """
  sizes = dict(zip(axes, shape))
  ranges = dict(zip(axes, block))
  hf_index, expanded, sub = [], [], []
  for outer, *inner in HF_LAYOUTS[leaf]:
    # Only the outermost axis of a flattened group is read selectively; the
    # inner ones (head_dim, which is never sharded) are read whole and cut here.
    stride = math.prod(sizes[a] for a in inner)
    r = ranges[outer]
    hf_index.append(slice(r.start * stride, r.stop * stride))
    expanded += [outer, *inner]
    sub += [slice(None)] + [ranges[a] for a in inner]
  data = read(tuple(hf_index))
  data = data.reshape([ranges[a].stop - ranges[a].start if a == g[0] else sizes[a]
                       for g in HF_LAYOUTS[leaf] for a in g])
  return data[tuple(sub)].transpose([expanded.index(a) for a in axes])


def to_hf(x: np.ndarray, leaf: str, axes: tuple[str, ...]) -> np.ndarray:
  """One layer of a ptx parameter (axes without `layers`) as its HF tensor."""
  order = [a for group in HF_LAYOUTS[leaf] for a in group]
  out_shape = hf_shape(leaf, axes, x.shape)
  return np.ascontiguousarray(x.transpose([axes.index(a) for a in order]).reshape(out_shape))
