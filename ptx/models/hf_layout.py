"""Tensor layouts: where each ptx parameter's axes sit in its HF tensor.

HF stores `nn.Linear` weights as [out, in] with heads flattened into one
axis; ptx keeps every logical axis separate ([D, H, K] for q). Each layout
below lists the HF tensor's axes as groups of ptx logical axes, a group being
one flattened HF axis (outermost first), so one table drives both directions:
`read_block` gathers any rectangular block of a ptx parameter from the HF
tensor (one layer at a time, only the rows it needs), and `to_hf` turns a
ptx array back into the HF tensor.

A family that stores tensors otherwise names its own table (`HFFamily.layouts`):
gpt-oss keeps each layer's experts in one tensor ([E, in, out], `FUSED_EXPERTS`),
the gate and up projections interleaved in one, gate_up_proj [E, D, 2F], whose
column 2f is the gate's unit f and 2f + 1 the up projection's. A `Part` at the
end of a group says so: ptx's parameter is one of `count` interleaved there.
A layout that names the `experts` axis holds every expert in one tensor; one
that does not is stored one tensor per expert (`per_expert`).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple

import numpy as np


class Part(NamedTuple):
  """A ptx parameter stored interleaved with `count - 1` others along an HF axis: its element i at i count + index."""

  index: int
  count: int


Group = tuple[str | None | Part, ...]
Layout = tuple[Group, ...]

HF_LAYOUTS: dict[str, Layout] = {
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
    "o_bias": (("embed",),),
    "sinks": (("heads",),),
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
    # A vision tower (`ptx.models.vision`): the patch embedding's HF tensor is a Conv2d kernel [Dv, C, P, P], whose
    # trailing axes ptx flattens into one (`CONV_KERNELS`); LayerNorm and linear biases; the connector's projection.
    "patch": (("embed",), (None,)),
    "patch_bias": (("embed",),),
    "pos": ((None,), ("embed",)),
    "attn_norm_bias": (("embed",),),
    "mlp_norm_bias": (("embed",),),
    "up_bias": (("mlp",),),
    "down_bias": (("embed",),),
    "post_norm": (("embed",),),
    "post_norm_bias": (("embed",),),
    "proj": (("embed",), (None,)),
}

# Parameters whose HF tensor is a convolution kernel [out, in, kernel...]: ptx holds its trailing axes flattened into
# the last group's one axis (in, kernel... in order), the weight of a matmul over flattened patches.
CONV_KERNELS = frozenset({"patch"})


# gpt-oss: each layer's experts in one tensor, [E, in, out]; gate_up_proj [E, D, 2F] and its bias [E, 2F] hold the gate
# and up projections interleaved (gate = [..., ::2], up = [..., 1::2]).
FUSED_EXPERTS: dict[str, Layout] = {
    **HF_LAYOUTS,
    "expert_gate": (("experts",), ("embed",), ("mlp", Part(0, 2))),
    "expert_up": (("experts",), ("embed",), ("mlp", Part(1, 2))),
    "expert_down": (("experts",), ("mlp",), ("embed",)),
    "expert_gate_bias": (("experts",), ("mlp", Part(0, 2))),
    "expert_up_bias": (("experts",), ("mlp", Part(1, 2))),
    "expert_down_bias": (("experts",), ("embed",)),
}


def flattened(leaf: str, hf_tensor_shape: tuple[int, ...]) -> tuple[int, ...]:
  """An HF tensor's shape as `leaf`'s layout groups see it: a convolution kernel's trailing axes as one."""
  if leaf not in CONV_KERNELS:
    return hf_tensor_shape
  return (hf_tensor_shape[0], math.prod(hf_tensor_shape[1:]))


def per_expert(leaf: str, axes: tuple[str | None, ...], layouts: Mapping[str, Layout] = HF_LAYOUTS) -> bool:
  """Whether ptx parameter `leaf` with these axes (without `layers`) is stored as one HF tensor per expert."""
  return bool(axes) and axes[0] == "experts" and not any("experts" in group for group in layouts[leaf])


def _size(axis: str | None | Part, sizes: dict) -> int:
  """A layout entry's size: its axis's in `sizes`, or a Part's interleave count."""
  return axis.count if isinstance(axis, Part) else sizes[axis]


def hf_shape(leaf: str, axes: tuple[str, ...], shape: tuple[int, ...],
             layouts: Mapping[str, Layout] = HF_LAYOUTS) -> tuple[int, ...]:
  """The HF tensor shape of one layer of ptx parameter `leaf` (axes and shape without `layers`)."""
  sizes = dict(zip(axes, shape))
  return tuple(math.prod(_size(a, sizes) for a in group) for group in layouts[leaf])


def read_block(read: Callable[[tuple[slice, ...]], np.ndarray], leaf: str, axes: tuple[str, ...],
               shape: tuple[int, ...], block: tuple[slice, ...],
               layouts: Mapping[str, Layout] = HF_LAYOUTS) -> np.ndarray:
  """Reads the block `block` of one layer of a ptx parameter from its HF tensor.

  Args:
    read: reads a rectangular slice of the HF tensor (safetensors `get_slice`).
    leaf: the ptx parameter name (a key of `layouts`).
    axes: its logical axes, without `layers`.
    shape: its shape, without `layers`.
    block: one slice per axis, with explicit start and stop.
    layouts: the family's table (`HFFamily.layouts`).

  Returns:
    The block, in ptx axis order.
  """
  sizes = dict(zip(axes, shape))
  ranges = dict(zip(axes, block))
  hf_index, expanded, sub = [], [], []
  for outer, *inner in layouts[leaf]:
    # Only the outermost axis of a flattened group is read selectively; the inner ones (head_dim, which is never
    # sharded, or a Part's interleave) are read whole and cut here.
    stride = math.prod(_size(a, sizes) for a in inner)
    r = ranges[outer]
    hf_index.append(slice(r.start * stride, r.stop * stride))
    expanded += [outer, *inner]
    sub += [slice(None)] + [a.index if isinstance(a, Part) else ranges[a] for a in inner]
  data = read(tuple(hf_index))
  data = data.reshape([ranges[g[0]].stop - ranges[g[0]].start if i == 0 else _size(a, sizes)
                       for g in layouts[leaf] for i, a in enumerate(g)])
  kept = [a for a in expanded if not isinstance(a, Part)]  # a Part's axis is indexed away
  return data[tuple(sub)].transpose([kept.index(a) for a in axes])


def to_hf(x: np.ndarray, leaf: str, axes: tuple[str, ...], layouts: Mapping[str, Layout] = HF_LAYOUTS,
          into: np.ndarray | None = None) -> np.ndarray:
  """One layer of a ptx parameter (axes without `layers`) as its HF tensor.

  A `Part` of a fused tensor is written into `into` (the tensor its other parts share; a new one when None) at its
  places, which the caller fills with the other parts before using it.
  """
  layout = layouts[leaf]
  expanded = [a for group in layout for a in group]
  kept = [a for a in expanded if not isinstance(a, Part)]
  out_shape = hf_shape(leaf, axes, x.shape, layouts)
  moved = x.transpose([axes.index(a) for a in kept])
  part = next((i for i, a in enumerate(expanded) if isinstance(a, Part)), None)
  if part is None:
    return np.ascontiguousarray(moved.reshape(out_shape))
  into = np.empty(out_shape, x.dtype) if into is None else into
  sizes = dict(zip(axes, x.shape))
  view = into.reshape([_size(a, sizes) for a in expanded])  # a view: `into` is contiguous
  view[(slice(None),) * part + (expanded[part].index,)] = moved
  return into
