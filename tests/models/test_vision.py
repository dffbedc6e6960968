"""The image encoder (`ptx.models.vision`): shapes, sharding on the fake 8-device mesh, a frozen tower, and the merge
of its features into the decoder's embeddings. Parity with transformers is tests/models/test_hf_idefics3.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ptx.config import OptimizerConfig
from ptx.data.image_tokens import image_slots
from ptx.model_config import ModelConfig, VisionConfig
from ptx.models import vision
from ptx.models import decoder
from ptx.models.hf_config import HFConfigError
from ptx.models.hf_save import check_exportable
from ptx.models.params import init_params, param_shardings, param_specs, trainable_mask, weight_decay_mask
from ptx.train.optimizer import make_optimizer

IMAGE_TOKEN = 263
# Pairwise distinct: tower width 24 (4 heads of 6, MLP 56; heads and MLP divide the mesh's tensor=4), 20-pixel
# images of 5-pixel patches (16 patches, 75 values each), 2 x 2 shuffle: 4 tokens per image; text d_model 40.
_VISION = VisionConfig(depth=2, image_size=20, patch_size=5, width=24, n_heads=4, mlp_dim=56, scale_factor=2,
                       image_token_id=IMAGE_TOKEN)


@pytest.fixture(scope="module")
def cfg():
  return ModelConfig(vocab_size=264, d_model=40, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=14, mlp_dim=96,
                     init_std=0.1, vision=_VISION)


# Jitted once per config: eager calls would dispatch each small op on its own (seconds on a loaded machine).
encode_images = jax.jit(vision.encode_images, static_argnums=2)
forward = jax.jit(decoder.forward, static_argnums=2)


@pytest.fixture(scope="module")
def params(cfg):
  @jax.jit
  def draw(key):
    p = init_params(cfg, key)
    # Norms start at (1, 0) and biases at 0: redraw them so that each matters.
    keys = iter(jax.random.split(jax.random.fold_in(key, 1), 64))
    return {**p, "vision": {k: w if k in ("patch", "pos", "q", "k", "v", "o", "up", "down") else
                            w + 0.1 * jax.random.normal(next(keys), w.shape) for k, w in p["vision"].items()}}

  return draw(jax.random.key(0))


def _pixels(n, seed=2):
  return jax.random.normal(jax.random.key(seed), (n, 3, 20, 20))


def test_a_text_model_has_no_vision_parameters_and_bad_shapes_are_refused(cfg, params):
  text = dataclasses.replace(cfg, vision=VisionConfig())
  assert not {"vision", "connector"} & param_specs(text).keys()
  assert trainable_mask(text) is None  # text models keep training every parameter
  with pytest.raises(ValueError, match="no vision tower"):
    encode_images(params, _pixels(1), text)
  with pytest.raises(ValueError, match=r"model.vision.channels, image_size"):
    encode_images(params, _pixels(1)[:, :, :15], cfg)
  with pytest.raises(ValueError, match="model.vision.scale_factor=3"):
    VisionConfig(depth=1, image_size=20, patch_size=5, scale_factor=3)
  with pytest.raises(ValueError, match="model.vision.image_token_id=300"):
    dataclasses.replace(cfg, vision=dataclasses.replace(_VISION, image_token_id=300))
  with pytest.raises(HFConfigError, match="llama has no vision tower; got model.vision.depth=2"):
    check_exportable(cfg)  # save_hf writes text families only: it refuses rather than drop the tower


def test_encode_images_gives_tokens_per_image_features_of_d_model(cfg, params):
  features = encode_images(params, _pixels(6).reshape(2, 3, 3, 20, 20), cfg)  # 2 rows of 3 tiles
  assert features.shape == (2, 3, _VISION.tokens_per_image, cfg.d_model) == (2, 3, 4, 40)
  assert features.dtype == jnp.float32
  # Images are encoded independently (bidirectional inside an image, nothing across images); float32 rounding of
  # another batch size's program is all that may differ.
  np.testing.assert_allclose(encode_images(params, _pixels(6)[4:5], cfg), features[1, 1:2], rtol=0, atol=1e-6)


def test_the_tower_shards_like_the_text_model_and_computes_the_same(cfg, params, mesh):
  shardings = param_shardings(cfg, mesh)
  for leaf in ("q", "o", "up", "down", "attn_norm"):  # the text layers' logical axes, so their layout
    assert shardings["vision"][leaf].spec == shardings["layers"][leaf].spec, leaf
  # Heads and MLP units over `tensor` (the tower's 4 kv heads divide it; the text model's 2 do not).
  assert shardings["vision"]["q"].spec[2] == shardings["vision"]["k"].spec[2] == shardings["vision"]["up"].spec[2]
  assert shardings["vision"]["up"].spec[2] == "tensor"
  assert shardings["connector"]["proj"].spec[1] == shardings["embed"].spec[1]
  want = encode_images(params, _pixels(4), cfg)
  with jax.set_mesh(mesh):
    sharded = jax.device_put(params, shardings)
    got = encode_images(sharded, _pixels(4), cfg)
  # float32 sums split over 4 tensor-parallel devices, in another order: rounding of O(1) features.
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_a_frozen_tower_gets_no_update_no_moments_and_no_decay(cfg, params):
  trainable, decayed = trainable_mask(cfg), weight_decay_mask(cfg)
  for part in ("vision", "connector"):
    assert not any(jax.tree.leaves(trainable[part])) and not any(jax.tree.leaves(decayed[part]))
  assert all(jax.tree.leaves(trainable["layers"])) and decayed["layers"]["q"]
  optimizer = make_optimizer(OptimizerConfig(lr=0.1, warmup_steps=0, weight_decay=0.1), 10, decayed, trainable)

  @jax.jit
  def step(params):
    state = optimizer.init(params)
    updates, state = optimizer.update(jax.tree.map(jnp.ones_like, params), state, params)
    return optax.apply_updates(params, updates), state

  new, state = step(params)
  adam = state.inner_state[1][1][0]  # apply_if_finite > chain(zero frozen, clip > adamw) > adam's moments
  for part in ("vision", "connector"):
    jax.tree.map(np.testing.assert_array_equal, new[part], params[part])
    assert not any(np.any(m) for m in jax.tree.leaves((adam.mu[part], adam.nu[part])))
  assert not np.array_equal(new["embed"], params["embed"])
  trained_tower = dataclasses.replace(cfg, vision=dataclasses.replace(_VISION, train_tower=True))
  assert all(jax.tree.leaves(trainable_mask(trained_tower)["vision"]))
  assert not trainable_mask(trained_tower)["connector"]["proj"]
  assert weight_decay_mask(trained_tower)["vision"]["q"] and not weight_decay_mask(trained_tower)["vision"]["q_bias"]


def _images(features, tokens):
  return vision.Images(features, jnp.asarray(image_slots(np.asarray(tokens), IMAGE_TOKEN)))


def test_merge_puts_each_feature_at_its_slot_of_its_row_and_keeps_text_embeddings():
  x = jax.random.normal(jax.random.key(3), (2, 7, 5))
  features = jax.random.normal(jax.random.key(4), (2, 3, 2, 5))  # per row: 3 tiles of 2 tokens
  slots = jnp.array([[-1, 4, 5, -1, -1, 0, -1], [1, -1, -1, 2, 3, -1, -1]], jnp.int32)
  merged = np.asarray(vision.merge_features(x, vision.Images(features, slots)))
  rows = np.asarray(features).reshape(2, 6, 5)
  for b, t in np.ndindex(2, 7):
    want = rows[b, slots[b, t]] if slots[b, t] >= 0 else np.asarray(x)[b, t]
    np.testing.assert_array_equal(merged[b, t], want)
  assert vision.merge_features(x, None) is x
  with pytest.raises(ValueError, match=r"slots \[2, 5\] must be int32 \[2, 7\]"):
    vision.merge_features(x, vision.Images(features, slots[:, :5]))
  with pytest.raises(ValueError, match=r"features \[6, 2, 5\] \[2, N, tokens_per_image, 5\]"):
    vision.merge_features(x, vision.Images(features.reshape(6, 2, 5), slots))


def test_text_before_the_image_sees_the_text_only_forward_and_the_image_changes_what_follows(cfg, params):
  tokens = jax.random.randint(jax.random.key(5), (2, 12), 0, 200)
  tokens = tokens.at[0, 3:7].set(IMAGE_TOKEN).at[1, 6:10].set(IMAGE_TOKEN)
  features = encode_images(params, _pixels(2)[:, None], cfg)  # one image per row
  with_images = forward(params, tokens, cfg, images=_images(features, tokens))
  text_only = forward(params, tokens, cfg)
  # Causal: positions before a row's first image token read the same inputs; float32 rounding of one program or the
  # other is all that may differ.
  np.testing.assert_allclose(with_images[0, :3], text_only[0, :3], rtol=0, atol=1e-6)
  np.testing.assert_allclose(with_images[1, :6], text_only[1, :6], rtol=0, atol=1e-6)
  assert np.abs(with_images[0, 3:] - text_only[0, 3:]).min(axis=-1).max() > 1e-3
  other = encode_images(params, _pixels(2, seed=6)[:, None], cfg)
  assert np.abs(forward(params, tokens, cfg, images=_images(other, tokens)) - with_images).max() > 1e-3
