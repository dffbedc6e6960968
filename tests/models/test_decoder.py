"""Properties of the decoder: causality, packing, padding, windows, presets."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ptx_kernels import xla_cpu_workarounds

from model_variants import gemma_like, mla_like, moe_like
from ptx.model_config import MODEL_PRESETS, RopeScaling
from ptx import sharding
from ptx.models import Decoder, count_params, init_params
from ptx.models.params import count_active_params
from ptx.models import forward as eager_forward
from ptx.models import decoder, gated_mlp
from ptx.models.decoder import decode_layers, unembed

forward = jax.jit(eager_forward, static_argnames=("cfg",))
# Two programs for the same float32 math (packed vs unpacked, padded, unrolled vs scanned, remat): their sums run in
# another order, ~1e-6 relative after the layers (logits O(1), seen <= 13% of these). atol covers values near 0.
REORDER_RTOL, REORDER_ATOL = 1e-5, 1e-5
# Gradients, the same: relative 1e-5, and atol 1e-6 for entries that are cancellations (seen <= 7% of it).
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-6

VARIANTS = {
    "llama": lambda c: c,
    "qwen2": lambda c: dataclasses.replace(c, qkv_bias=True, tie_embeddings=True),
    "qwen3": lambda c: dataclasses.replace(c, qk_norm=True),
    "llama31_rope": lambda c: dataclasses.replace(
        c, rope_scaling=RopeScaling(kind="llama3", factor=8.0, original_max_positions=16)),
    "gemma": gemma_like,
    "moe": moe_like,
    "mla": mla_like,
}


def _params(cfg, seed=0):
  params = init_params(cfg, jax.random.key(seed))
  # Perturb the zero-initialised biases and (1 + w) norms so they matter.
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_causality_through_gradients(tiny_config, variant):
  cfg = VARIANTS[variant](tiny_config)
  params = _params(cfg)
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, cfg.vocab_size)
  t = 6

  def logits_at_t(onehot):  # the decoder applied to one-hot inputs, so inputs have gradients
    x = onehot @ params["embed"]
    if cfg.embed_scale:
      x = x * jnp.sqrt(jnp.float32(cfg.d_model))
    x, _ = decode_layers(params, x, cfg, positions=None, segment_ids=None, rules=sharding.DEFAULT_RULES)
    return unembed(params, x, cfg, sharding.DEFAULT_RULES)[:, t].sum()

  onehot = jax.nn.one_hot(tokens, cfg.vocab_size)
  grad = jax.jit(jax.grad(logits_at_t))(onehot)
  influence = np.abs(np.asarray(grad)).sum(axis=(0, 2))
  assert np.all(influence[t + 1:] == 0), f"future tokens influence position {t}: {influence}"
  assert np.all(influence[: t + 1] > 0), f"some past token has no influence: {influence}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_packed_equals_unpacked(tiny_config, variant):
  cfg = VARIANTS[variant](tiny_config)
  params = _params(cfg)
  a = jax.random.randint(jax.random.key(3), (5,), 0, cfg.vocab_size)
  b = jax.random.randint(jax.random.key(4), (7,), 0, cfg.vocab_size)
  packed = jnp.concatenate([a, b, jnp.zeros(4, jnp.int32)])[None]
  segments = jnp.asarray([[1] * 5 + [2] * 7 + [0] * 4])
  positions = jnp.asarray([list(range(5)) + list(range(7)) + [0] * 4])
  logits = forward(params, packed, cfg, positions=positions, segment_ids=segments)
  np.testing.assert_allclose(logits[0, :5], forward(params, a[None], cfg)[0], atol=REORDER_ATOL, rtol=REORDER_RTOL)
  np.testing.assert_allclose(logits[0, 5:12], forward(params, b[None], cfg)[0], atol=REORDER_ATOL, rtol=REORDER_RTOL)


def test_padding_changes_nothing(tiny_config):
  cfg = gemma_like(tiny_config)
  params = _params(cfg)
  tokens = jax.random.randint(jax.random.key(5), (1, 9), 0, cfg.vocab_size)
  padded = jnp.concatenate([tokens, jnp.full((1, 5), 7, jnp.int32)], axis=1)
  segments = jnp.asarray([[1] * 9 + [0] * 5])
  positions = jnp.asarray([list(range(9)) + [0] * 5])
  logits = forward(params, padded, cfg, positions=positions, segment_ids=segments)
  np.testing.assert_allclose(logits[0, :9], forward(params, tokens, cfg)[0], atol=REORDER_ATOL, rtol=REORDER_RTOL)
  assert np.isfinite(np.asarray(logits)).all()


def test_sliding_window_limits_the_receptive_field(tiny_config):
  # Every layer local with window 2 and one layer: position t sees only t-1 and t.
  cfg = dataclasses.replace(tiny_config, n_layers=1, sliding_window=2, sliding_window_pattern=1)
  params = _params(cfg)
  tokens = jax.random.randint(jax.random.key(6), (1, 10), 0, cfg.vocab_size)
  changed = tokens.at[0, 3].set((tokens[0, 3] + 1) % cfg.vocab_size)
  # Exact zeros: one program, and masked keys add exact zeros, so outputs that cannot see the change are bit-equal.
  diff = np.abs(np.asarray(forward(params, tokens, cfg) - forward(params, changed, cfg))).max(axis=-1)[0]
  assert np.all(diff[:3] == 0) and diff[3] > 0 and diff[4] > 0
  assert np.all(diff[5:] == 0), f"a token outside the window changed the output: {diff}"


def test_gemma_global_layers_see_past_the_window(tiny_config):
  cfg = dataclasses.replace(gemma_like(tiny_config), n_layers=2)  # layer 0 local, layer 1 global
  params = _params(cfg)
  tokens = jax.random.randint(jax.random.key(7), (1, 10), 0, cfg.vocab_size)
  changed = tokens.at[0, 0].set((tokens[0, 0] + 1) % cfg.vocab_size)
  diff = np.abs(np.asarray(forward(params, tokens, cfg) - forward(params, changed, cfg))).max(axis=-1)[0]
  assert diff[9] > 0


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
def test_remat_gives_the_same_gradients(tiny_config, remat):
  cfg = tiny_config
  params = _params(cfg)
  tokens = jax.random.randint(jax.random.key(8), (2, 8), 0, cfg.vocab_size)
  loss = lambda p, c: forward(p, tokens, c).mean()
  grad = jax.jit(jax.grad(loss), static_argnums=1)
  want = grad(params, cfg)
  got = grad(params, dataclasses.replace(cfg, remat=remat))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=GRAD_ATOL, rtol=GRAD_RTOL), got, want)


@pytest.mark.parametrize("variant", ["llama", "gemma"])
@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_layers_equal_the_scan(tiny_config, variant, remat):
  """scan_layers=False runs the same layers: same logits, same gradients for the stacked weights."""
  cfg = dataclasses.replace(VARIANTS[variant](tiny_config), remat=remat)
  params = _params(cfg)
  tokens = jax.random.randint(jax.random.key(9), (2, 8), 0, cfg.vocab_size)
  loss = lambda p, c: (forward(p, tokens, c) ** 2).mean()
  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  want_loss, want = grad(params, cfg)
  got_loss, got = grad(params, dataclasses.replace(cfg, scan_layers=False))
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)  # one scalar mean: a few ulps (bit-equal here)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=GRAD_ATOL, rtol=GRAD_RTOL), got, want)


def test_cached_decoding_runs_under_remat(tiny_config):
  """A remat config still samples: the layer index that picks the cache's arrays stays static."""
  from ptx.models import kv_cache
  from ptx.models.decoder import forward_with_cache
  tokens = jax.random.randint(jax.random.key(10), (2, 6), 0, tiny_config.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))

  def run(cfg):
    params = _params(cfg)
    cache = kv_cache.init_cache(cfg, 2, 8)
    return jax.jit(lambda p, c: forward_with_cache(p, tokens, cfg, c, positions=positions)[0])(params, cache)

  # Remat recomputes the same operations: bit-equal here; atol 1e-6 on O(1) logits allows a reordering.
  np.testing.assert_allclose(run(dataclasses.replace(tiny_config, remat="full")), run(tiny_config), atol=1e-6)


def test_bfloat16_compute_keeps_float32_logits(tiny_config):
  cfg = dataclasses.replace(tiny_config, param_dtype="bfloat16", compute_dtype="bfloat16")
  params = init_params(cfg, jax.random.key(0))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  logits = forward(params, jnp.zeros((1, 4), jnp.int32), cfg)
  assert logits.dtype == jnp.float32


def test_nnx_module_matches_forward_and_splits(tiny_config):
  model = Decoder(tiny_config, rngs=nnx.Rngs(0))
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  graphdef, state = nnx.split(model)
  # Exact: the module calls the same jitted forward on the same arrays.
  np.testing.assert_array_equal(model(tokens), forward(nnx.to_pure_dict(state), tokens, tiny_config))
  np.testing.assert_array_equal(nnx.merge(graphdef, state)(tokens), model(tokens))
  with pytest.raises(ValueError, match="exactly one"):
    Decoder(tiny_config)
  with pytest.raises(ValueError, match="does not match"):
    Decoder(tiny_config, params={"embed": model.params["embed"]})


def test_sharded_module_init(tiny_config, mesh):
  model = Decoder(tiny_config, rngs=nnx.Rngs(0), mesh=mesh)
  q = model.params["layers"]["q"]
  assert q.sharding.spec[2] == "tensor" and q.sharding.mesh == mesh
  # Exact: partitionable threefry draws the same bits however the output is sharded; the rest is elementwise.
  np.testing.assert_array_equal(q, Decoder(tiny_config, rngs=nnx.Rngs(0)).params["layers"]["q"])


# Published parameter counts (model cards / safetensors index totals).
PUBLISHED = {
    "llama3_8b": 8_030_261_248,
    "llama3_1_8b": 8_030_261_248,
    "llama3_2_1b": 1_235_814_400,
    "smollm2_135m": 134_515_008,
    "qwen2_5_0_5b": 494_032_768,
    "qwen2_5_7b": 7_615_616_512,
    "qwen3_8b": 8_190_735_360,
    "gemma2_2b": 2_614_341_888,
    "gemma2_9b": 9_241_705_984,
    "gemma3_1b": 999_885_952,
    "qwen3_30b_a3b": 30_532_122_624,
    "qwen3_235b_a22b": 235_093_634_560,
    "mixtral_8x7b": 46_702_792_704,
    # DeepSeek-V3's 671B (its report): the main model; the HF checkpoint's 685B adds the 14B MTP layer ptx skips.
    "deepseek_v3_671b": 671_026_419_200,
    # Kimi K2's model card says "1T"; this is the sum over its config.json's shapes (ptx/models/deepseek.py).
    "kimi_k2": 1_026_408_232_448,
    # gpt-oss's model card: 20.91B and 116.83B (the hub checkpoints' shapes, bf16 as before MXFP4 packing).
    "gpt_oss_20b": 20_914_757_184,
    "gpt_oss_120b": 116_829_156_672,
}
# Active parameters of the Mixtures of Experts, as Qwen's model card rounds them ("3.3B activated", "22B") and as
# the dense count of Mixtral's embeddings, attention and two of eight experts ("12.9B").
PUBLISHED_ACTIVE = {"qwen3_30b_a3b": 3_353_032_704, "qwen3_235b_a22b": 22.2e9, "mixtral_8x7b": 12.9e9}
# DeepSeek-V3's report says "37B activated", Kimi K2's card "32B": the counts (37.55B, 32.86B, embedding and output
# tables included) are within 3% of those rounded figures.
ROUNDED_ACTIVE = {"deepseek_v3_671b": 37e9, "kimi_k2": 32e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
  assert count_params(MODEL_PRESETS[name]()) == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_moe_preset_active_parameter_counts(name):
  assert count_active_params(MODEL_PRESETS[name]()) == pytest.approx(PUBLISHED_ACTIVE[name], rel=5e-3)


@pytest.mark.parametrize("name", sorted(ROUNDED_ACTIVE))
def test_mla_preset_active_parameter_counts(name):
  assert count_active_params(MODEL_PRESETS[name]()) == pytest.approx(ROUNDED_ACTIVE[name], rel=0.03)


def test_every_real_preset_has_a_published_count():
  assert set(MODEL_PRESETS) - {"tiny"} == set(PUBLISHED)


@pytest.mark.parametrize("variant", ["llama31_rope", "gemma"])
def test_layer_rope_behind_its_cpu_conditional_is_the_plain_computation(tiny_config, variant):
  """The CPU fusion barrier changes nothing: same angles, bit for bit, also for all-zero positions."""
  cfg = VARIANTS[variant](tiny_config)
  positions = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 3], [5, 9, 100, 4095, 0, 0, 7, 8]], jnp.int32)
  for p in (positions, jnp.zeros_like(positions)):
    got = jax.jit(decoder.layer_rope, static_argnums=1)(p, cfg)
    want = jax.jit(decoder._layer_rope, static_argnums=1)(p, cfg)
    jax.tree.map(np.testing.assert_array_equal, got, want)
  zero_sin, zero_cos = decoder.layer_rope(jnp.zeros_like(positions), cfg)[0]
  assert not np.asarray(zero_sin).any() and np.asarray(zero_cos).min() > 0


def test_cpu_forward_computes_rope_trig_once(tiny_config):
  """On XLA:CPU sin and cos are evaluated into [B, T, K/2] tables only, not per rotated element (the barrier holds)."""
  cfg = dataclasses.replace(tiny_config, scan_layers=False)
  params = _params(cfg)
  tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, cfg.vocab_size)
  loss = lambda p: (forward(p, tokens, cfg) ** 2).mean()
  with xla_cpu_workarounds.override(True):
    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
  table_size = 2 * 8 * cfg.head_dim // 2
  for block in hlo.split("\n\n"):
    if "sine(" in block or "cosine(" in block:
      output = re.search(r"-> \(?f32\[([\d,]*)\]", block.strip().split("\n")[0])
      assert output and math.prod(int(n) for n in output.group(1).split(",")) <= table_size, block[:500]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "clamped_swiglu"])
def test_gated_activation_gradients_equal_autodiff(activation):
  """The written-out backward of act(gate, up) gives autodiff's gradients (clamped past a limit of 2 here)."""
  gate, up, d_out = jax.random.normal(jax.random.key(4), (3, 2, 5, 16)) * 3
  plain = lambda g, u: gated_mlp._ACTIVATIONS[activation](g, u, 2.0)
  fused = functools.partial(gated_mlp.gated_activation, gated_mlp.Activation(activation, 2.0))
  np.testing.assert_array_equal(jax.jit(fused)(gate, up), jax.jit(plain)(gate, up))  # the same elementwise ops
  want = jax.jit(lambda g, u, d: jax.vjp(plain, g, u)[1](d))(gate, up, d_out)
  got = jax.jit(lambda g, u, d: jax.vjp(fused, g, u)[1](d))(gate, up, d_out)
  # Elementwise, no sums: the written-out derivative may round an operation or two differently (bit-equal here).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, want)
