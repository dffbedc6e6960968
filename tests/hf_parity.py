"""What the HF parity tests share: redrawing a transformers model's weights and both sides' logits (importable:
conftest modules are not)."""

import jax.numpy as jnp
import numpy as np


def randomize(model, seed, scale=0.2):
  """`model` (a transformers model) with every parameter redrawn N(0, scale^2), norms and biases included, so that
  each matters; in eval mode."""
  import torch

  torch.manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * scale)
  return model.eval()


def hf_logits(model, tokens):
  """transformers' float32 logits of int tokens [B, T]."""
  import torch

  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.float().numpy()


def ptx_logits(model, tokens):
  """A ptx Decoder's float32 logits of int tokens [B, T]."""
  return np.asarray(model(jnp.asarray(tokens, jnp.int32)))
