"""Idefics3 and SmolVLM (a SigLIP tower, the pixel-shuffle connector, a Llama text model) against transformers.

A tiny random `Idefics3ForConditionalGeneration` and `SmolVLMForConditionalGeneration`, every weight redrawn (norms,
biases, the connector and the position embedding included: `hf_parity.randomize`), saved by transformers and loaded
by ptx: text+image logits within 1e-4 of transformers' in float32 for two rows with one image each, its image tokens
expanded as the processor does for one tile (the <image> run of tokens_per_image ids between
<fake_token_around_image> markers; any ids serve for the markers here). The same check fails when the tower's query
projections are read transposed, the patch kernel in another order or the connector's pixel shuffle takes a block's
patches column by column, so it cannot pass by accident (measured: 3.6e-7 against logits of 1.2; a transposed query
projection moves them 0.23).
"""

import numpy as np
import pytest
import jax.numpy as jnp

from hf_parity import randomize
from ptx.data.image_tokens import image_slots
from ptx.models import load_hf, vision
from ptx.models.decoder import forward

torch = pytest.importorskip("torch", reason="HF parity tests need torch (installed by `make test`)")
transformers = pytest.importorskip("transformers", reason="HF parity tests need transformers (`make test`)")

pytestmark = pytest.mark.slow

IMAGE_TOKEN = 90
# Pairwise distinct widths: text d_model 24 (4 heads of 6, 2 kv heads, MLP 40); tower width 20 (4 heads of 5, MLP
# 36), 24-pixel images of 4-pixel patches: 36 patches, 9 image tokens after the 2 x 2 pixel shuffle.
_TEXT = dict(model_type="llama", vocab_size=96, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=6, rms_norm_eps=1e-6)
_VISION = dict(hidden_size=20, intermediate_size=36, num_hidden_layers=2, num_attention_heads=4, image_size=24,
               patch_size=4, layer_norm_eps=1e-6)
TOKENS_PER_IMAGE = 9


def _prompt(rng) -> np.ndarray:
  """Two rows of text, a marker, an image's 9 <image> tokens, a marker, text; images at different places."""
  rows = []
  for before in (3, 7):
    text = rng.integers(0, 80, 20 - TOKENS_PER_IMAGE)
    rows.append(np.concatenate([text[:before], [91], [IMAGE_TOKEN] * TOKENS_PER_IMAGE, [91], text[before:-2]]))
  return np.stack(rows)


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def checkpoint(request, tmp_path_factory):
  """(directory, tokens, pixel values [rows, 1, C, H, W], transformers' logits) of a saved tiny random model."""
  classes = {"idefics3": (transformers.Idefics3Config, transformers.Idefics3ForConditionalGeneration),
             "smolvlm": (transformers.SmolVLMConfig, transformers.SmolVLMForConditionalGeneration)}
  config_class, model_class = classes[request.param]
  config = config_class(text_config=_TEXT, vision_config=_VISION, scale_factor=2, image_token_id=IMAGE_TOKEN)
  model = randomize(model_class(config), 0)
  with torch.no_grad():  # the tower's LayerNorm scales about 1, not 0: else its attention is nearly uniform
    for name, p in model.named_parameters():
      if name.startswith("model.vision_model.") and "layernorm" in name.replace("_", "") and name.endswith("weight"):
        p.add_(1.0)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path)
  rng = np.random.default_rng(1)
  tokens = _prompt(rng)
  pixels = rng.normal(size=(2, 1, 3, 24, 24)).astype(np.float32)
  with torch.no_grad():
    logits = model(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels)).logits.float().numpy()
  return path, tokens, pixels, logits


def _ptx_logits(model, tokens, pixels):
  features = vision.encode_images(model.params, jnp.asarray(pixels), model.cfg)  # [rows, 1 image, 9, D]
  images = vision.Images(features, jnp.asarray(image_slots(tokens, IMAGE_TOKEN)))
  return np.asarray(forward(model.params, jnp.asarray(tokens, jnp.int32), model.cfg, images=images))


# HF parity in float32, as tests/models/test_hf.py asks of every family: reordered float32 sums through 2 tower and 2
# text layers, logits of O(1).
_ATOL = 1e-4


def test_load_matches_transformers(checkpoint):
  path, tokens, pixels, expected = checkpoint
  model = load_hf(path)
  vc = model.cfg.vision
  assert (vc.depth, vc.width, vc.n_heads, vc.mlp_dim, vc.image_size, vc.patch_size, vc.scale_factor) == (
      2, 20, 4, 36, 24, 4, 2)
  assert (vc.image_token_id, vc.tokens_per_image) == (IMAGE_TOKEN, TOKENS_PER_IMAGE)
  np.testing.assert_allclose(_ptx_logits(model, tokens, pixels), expected, atol=_ATOL, rtol=0)


def test_a_transposed_weight_or_a_wrong_patch_or_shuffle_order_fails_the_comparison(checkpoint, monkeypatch):
  """Each mistake moves the logits far past the tolerance: the parity test above can fail."""
  path, tokens, pixels, expected = checkpoint
  model = load_hf(path)
  tower = model.params["vision"]
  patch, q = tower["patch"], tower["q"]
  mistakes = {
      # The kernel read as (row, column, channel) patches instead of the Conv2d's (channel, row, column).
      "patch": patch.reshape(3, 4, 4, -1).transpose(1, 2, 0, 3).reshape(patch.shape),
      # The query projections [D, H x K] of the tower's layers read transposed (square here: 20 x 20).
      "q": q.reshape(2, 20, 20).transpose(0, 2, 1).reshape(q.shape),
  }
  for leaf, wrong in mistakes.items():
    params = {**model.params, "vision": {**tower, leaf: wrong}}
    logits = _ptx_logits(type(model)(model.cfg, params=params), tokens, pixels)
    assert np.abs(logits - expected).max() > 100 * _ATOL, leaf

  def column_major(x, scale):  # each block's patches column by column
    n, s, e = x.shape
    blocks = int(round(s ** 0.5)) // scale
    x = x.reshape(n, blocks, scale, blocks, scale, e).transpose(0, 1, 3, 4, 2, 5)
    return x.reshape(n, blocks * blocks, scale * scale * e)

  monkeypatch.setattr(vision, "pixel_shuffle", column_major)
  assert np.abs(_ptx_logits(model, tokens, pixels) - expected).max() > 100 * _ATOL
