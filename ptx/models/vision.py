"""The image encoder: a SigLIP ViT and the Idefics3 / SmolVLM connector, and where its features enter the decoder.

`encode_images(params, pixel_values, cfg)` turns images [..., C, H, W] (tiles, `model.vision.image_size` square,
normalised as the family's processor does: `ptx.data.images`) into features [..., tokens_per_image, d_model]:

  patches    each P x P patch flattened in (channel, row, column) order, the order of HF's Conv2d kernel
             [Dv, C, P, P], times `patch` [C P P, Dv], + `patch_bias` + the learned `pos` of its index (row-major)
  layers     pre-LayerNorm bidirectional attention (q, k, v, o with biases; every patch sees every patch of its image)
             and a GELU-tanh MLP (up, down with biases), stacked on `layers` and run under one scan
  post_norm  a final LayerNorm
  connector  the pixel shuffle (each scale x scale block of patches concatenated into one vector, as transformers'
             `Idefics3Connector.pixel_shuffle` orders it) and a linear projection to d_model (`proj`, no bias)

`merge_features(x, Images(features, slots))` puts the features into the decoder's embeddings: position t of row b
takes row `slots[b, t]` of row b's own features [N x tokens_per_image, D] (its N tiles, padding tiles included, in
order) where that is >= 0 and keeps its token's embedding where it is -1: a gather within the row and a select, with
static shapes (no scatter), so features stay with their row's batch shard. The host computes the slots from the
expanded image tokens (`ptx.data.image_tokens.image_slots`, `ptx.data.batch`).

Numerics: matmuls in `model.compute_dtype`; LayerNorm statistics and the attention softmax in float32.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ptx_kernels

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models.dense import dense

Params = dict[str, Any]
# The tower's leaves that are not per-layer (the others carry the stacked `layers` axis, `ptx.models.params`).
_UNSTACKED = ("patch", "patch_bias", "pos", "post_norm", "post_norm_bias")


class Images(NamedTuple):
  """The images of a batch as the decoder takes them (`decoder.forward`'s `images`)."""

  # [B, N, tokens_per_image, D] features of each row's N tiles (`encode_images` of the batch's pixel_values).
  features: jax.Array
  # int32 [B, T]: the row of the row's flattened [N x tokens_per_image, D] features at each image token, -1 for text.
  slots: jax.Array


def encode_images(params: Params, pixel_values: jax.Array, cfg: ModelConfig,
                  rules: sharding.Rules = sharding.DEFAULT_RULES) -> jax.Array:
  """Runs the vision tower and the connector on a batch of images.

  Args:
    params: the model's parameter tree, with its `vision` and `connector` subtrees (`ptx.models.params`).
    pixel_values: float [..., channels, image_size, image_size] tiles, normalised (HF's `pixel_values`; a batch's
      [B, N, ...] tiles per row, as `ptx.data.batch` lays them out).
    cfg: the model config; `cfg.vision` describes the tower.
    rules: the sharding rules for activation constraints (used under a mesh).

  Returns:
    Features [..., tokens_per_image, d_model] in the compute dtype, one row per image token.

  Raises:
    ValueError: for a model without a vision tower, or images of another shape than `cfg.vision` says.
  """
  vc = cfg.vision
  if not vc.enabled:
    raise ValueError("encode_images: the model has no vision tower (model.vision.depth is 0)")
  want = (vc.channels, vc.image_size, vc.image_size)
  if pixel_values.ndim < 4 or tuple(pixel_values.shape[-3:]) != want:
    raise ValueError(f"encode_images: pixel_values {tuple(pixel_values.shape)} must be [..., "
                     f"{', '.join(map(str, want))}] (model.vision.channels, image_size, image_size)")
  # A frozen part (`train_tower`, `train_connector` False) takes no gradient: the backward pass skips it, where the
  # optimizer would only zero its gradient (`params.trainable_mask`), and `grad_norm` counts what trains.
  p = params["vision"] if vc.train_tower else jax.lax.stop_gradient(params["vision"])
  connector = params["connector"] if vc.train_connector else jax.lax.stop_gradient(params["connector"])
  leading = pixel_values.shape[:-3]
  x = _embed_patches(p, pixel_values.reshape((-1,) + want), cfg, rules)
  layers = {name: w for name, w in p.items() if name not in _UNSTACKED}

  def body(x, layer):
    return _encoder_layer(layer, x, cfg, rules), None

  x, _ = jax.lax.scan(body, x, layers)
  x = _layer_norm(x, p["post_norm"], p["post_norm_bias"], vc.norm_eps)
  features = connect(connector, x, cfg, rules)
  return features.reshape(leading + features.shape[1:])


def connect(connector: Params, x: jax.Array, cfg: ModelConfig, rules: sharding.Rules) -> jax.Array:
  """The connector: pixel shuffle of the tower's output [N, n_patches, width], then `proj` to [N, tokens, d_model]."""
  x = pixel_shuffle(x, cfg.vision.scale_factor)
  out = dense("nsf,fd->nsd", x, connector["proj"].astype(cfg.compute_dtype))
  return sharding.constrain(out, ("batch", None, "embed"), rules)


def pixel_shuffle(x: jax.Array, scale: int) -> jax.Array:
  """[N, S, E] patches of a square grid -> [N, S / scale^2, scale^2 E]: each scale x scale block as one vector.

  Blocks in row-major order; a block's vector concatenates its patches row by row (offset r, then c), as
  transformers' `Idefics3Connector.pixel_shuffle` (a chain of views and permutes) leaves them.
  """
  n, s, e = x.shape
  side = int(round(s ** 0.5))
  blocks = side // scale
  x = x.reshape(n, blocks, scale, blocks, scale, e)  # [n, I, r, J, c, e]: patch (I scale + r, J scale + c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(n, blocks * blocks, scale * scale * e)


def merge_features(x: jax.Array, images: Images | None, rules: sharding.Rules = sharding.DEFAULT_RULES) -> jax.Array:
  """The embeddings x [B, T, D] with image-token positions replaced by their features (none: x itself).

  Args:
    x: the token embeddings [B, T, D].
    images: each row's features and the slots of its image tokens; None for a text-only batch (a program without
      images, chosen by the arguments' structure, not inside the trace).
    rules: the sharding rules for activation constraints.

  Returns:
    [B, T, D] in x's dtype.

  Raises:
    ValueError: when the slots or the features are not laid out per row of x.
  """
  if images is None:
    return x
  B, T, D = x.shape
  features, slots = images
  if slots.shape != (B, T) or features.shape[0] != B or features.shape[-1] != D:
    raise ValueError(f"images: slots {list(slots.shape)} must be int32 [{B}, {T}] (the tokens' shape) and features "
                     f"{list(features.shape)} [{B}, N, tokens_per_image, {D}]")
  rows = features.reshape(B, -1, D).astype(x.dtype)
  picked = jnp.take_along_axis(rows, jnp.maximum(slots, 0)[..., None], axis=1)
  return sharding.constrain(jnp.where(slots[..., None] >= 0, picked, x), ("batch", "seq", "embed"), rules)


def _embed_patches(p: Params, pixel_values: jax.Array, cfg: ModelConfig, rules: sharding.Rules) -> jax.Array:
  """[N, C, H, W] images -> [N, n_patches, width]: flattened patches times `patch`, plus bias and position."""
  vc = cfg.vision
  n, c, side, size = pixel_values.shape[0], vc.channels, vc.patches_per_side, vc.patch_size
  x = pixel_values.astype(cfg.compute_dtype).reshape(n, c, side, size, side, size)
  x = x.transpose(0, 2, 4, 1, 3, 5).reshape(n, vc.n_patches, vc.patch_dim)  # (C, P, P): the Conv2d kernel's order
  x = dense("nsf,fd->nsd", x, p["patch"].astype(cfg.compute_dtype))
  x = x + (p["patch_bias"][None, None] + p["pos"][None]).astype(cfg.compute_dtype)
  return sharding.constrain(x, ("batch", None, "embed"), rules)


def _encoder_layer(p: Params, x: jax.Array, cfg: ModelConfig, rules: sharding.Rules) -> jax.Array:
  """One SigLIP encoder layer: x + attention(LN(x)), then + MLP(LN(x)); every patch attends to every patch."""
  vc, dtype = cfg.vision, cfg.compute_dtype
  h = _layer_norm(x, p["attn_norm"], p["attn_norm_bias"], vc.norm_eps)
  q, k, v = (dense("nsd,dhk->nshk", h, p[name].astype(dtype)) + p[f"{name}_bias"].astype(dtype)[None, None]
             for name in ("q", "k", "v"))
  q = sharding.constrain(q, ("batch", None, "heads", "head_dim"), rules)
  k = sharding.constrain(k, ("batch", None, "kv_heads", "head_dim"), rules)
  v = sharding.constrain(v, ("batch", None, "kv_heads", "head_dim"), rules)
  out, _ = ptx_kernels.dense_attention(q, k, v, causal=False)  # bidirectional; scale head_dim ** -0.5, as SigLIP's
  out = dense("nshk,hkd->nsd", out, p["o"].astype(dtype)) + p["o_bias"].astype(dtype)[None, None]
  x = sharding.constrain(x + out, ("batch", None, "embed"), rules)
  h = _layer_norm(x, p["mlp_norm"], p["mlp_norm_bias"], vc.norm_eps)
  h = dense("nsd,df->nsf", h, p["up"].astype(dtype)) + p["up_bias"].astype(dtype)[None, None]
  h = sharding.constrain(jax.nn.gelu(h, approximate=True), ("batch", None, "mlp"), rules)  # HF gelu_pytorch_tanh
  out = dense("nsf,fd->nsd", h, p["down"].astype(dtype)) + p["down_bias"].astype(dtype)[None, None]
  return sharding.constrain(x + out, ("batch", None, "embed"), rules)


def _layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
  """LayerNorm over the last axis, its statistics in float32, the result in x's dtype."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  scale, shift = (w.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + w.shape) for w in (weight, bias))
  out = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale + shift
  return out.astype(x.dtype)
