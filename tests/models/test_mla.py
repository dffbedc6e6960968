"""Multi-head latent attention: its config, weights, naive forward under every attention implementation, the absorbed
decode over a latent cache and GRPO through it. HF parity is in test_hf_deepseek.py; the latent pages of the rollout
engine are tested in tests/sampling/test_engine.py."""

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import grpo_steps
from model_variants import mla_like, moe_like
from tolerances import assert_close_to_scale
from ptx import config_rules
from ptx.config import Config, GRPOConfig, MeshConfig
from ptx.model_config import MlaConfig, RopeScaling
from ptx.models import count_params, forward, init_params
from ptx.models import kv_cache, mla
from ptx.models.attention import interpret_pallas
from ptx.models.decoder import forward_with_cache
from ptx.models.memory_floor import training_floor_bytes
from ptx.models.params import abstract_params
from ptx.sampling.rules import SamplingConfig
from ptx.sharding import make_mesh

# As tests/models/test_attention.py: the kernels sum the softmax in another order than the XLA reference, float32
# rounding ~1e-6 relative on O(1) logits; gradients are compared to each leaf's scale.
LOGITS_TOL, GRADS_REL = 1e-5, 1e-5


def test_weights_replace_q_k_v_and_o(tiny_config):
  cfg = mla_like(tiny_config)
  L, D, H = cfg.n_layers, cfg.d_model, cfg.n_heads
  shapes = {name: x.shape for name, x in abstract_params(cfg)["layers"].items()}
  attention = {name: shape for name, shape in shapes.items() if name not in ("attn_norm", "mlp_norm", "gate", "up",
                                                                              "down")}
  assert attention == {"q_a": (L, D, 20), "q_a_norm": (L, 20), "q_b": (L, 20, H, 10 + 4), "kv_a": (L, D, 12 + 4),
                       "kv_a_norm": (L, 12), "kv_b": (L, 12, H, 10 + 6), "o": (L, H, 6, D)}
  gqa = 2 * D * H * 14 + 2 * D * 2 * 14  # q and o, k and v of the tiny config's grouped-query attention
  latent = D * 20 + 20 + 20 * H * 14 + D * 16 + 12 + 12 * H * 16 + H * 6 * D
  assert count_params(cfg) == count_params(tiny_config) + L * (latent - gqa)
  no_q_lora = mla_like(tiny_config, q_lora_rank=0)
  q_shapes = abstract_params(no_q_lora)["layers"]
  assert q_shapes["q"].shape == (L, D, H, 14) and "q_a" not in q_shapes
  assert count_params(no_q_lora) == count_params(cfg) - L * (D * 20 + 20 + 20 * H * 14) + L * D * H * 14


@pytest.mark.parametrize("change, message", [
    (dict(mla=dict(kv_lora_rank=8)), "model.mla.qk_nope_head_dim and model.mla.v_head_dim must be >= 1"),
    (dict(mla=dict(q_lora_rank=8)), "model.mla.kv_lora_rank=0 turns MLA off"),
    (dict(mla=dict(kv_lora_rank=-1)), "model.mla.q_lora_rank and model.mla.kv_lora_rank must be >= 0"),
    (dict(n_kv_heads=2), "model.n_kv_heads must equal model.n_heads=8"),
    (dict(head_dim=5), "model.head_dim .the rotary width. must be even"),
    (dict(qk_norm=True), "no model.qk_norm"),
    (dict(qkv_bias=True), "no model.qkv_bias"),
])
def test_config_errors_name_the_field(tiny_config, change, message):
  with pytest.raises(ValueError, match=message):
    if "mla" in change:
      MlaConfig(**change["mla"])
    dataclasses.replace(mla_like(tiny_config), **change)


def test_softmax_scale_takes_yarn_mscale_all_dim_squared(tiny_config):
  cfg = mla_like(tiny_config)
  assert mla.softmax_scale(cfg) == 14 ** -0.5
  yarn = RopeScaling(kind="yarn", factor=40.0, original_max_positions=16, mscale=1.0, mscale_all_dim=0.7)
  # Both sides Python floats of one formula (transformers `yarn_apply_mscale`): float64 rounding only.
  want = 14 ** -0.5 * (0.1 * 0.7 * math.log(40.0) + 1) ** 2
  assert mla.softmax_scale(dataclasses.replace(cfg, rope_scaling=yarn)) == pytest.approx(want, rel=1e-12)
  plain_yarn = dataclasses.replace(yarn, mscale=0.0, mscale_all_dim=0.0)
  assert mla.softmax_scale(dataclasses.replace(cfg, rope_scaling=plain_yarn)) == 14 ** -0.5


def _one_layer(cfg):
  return dataclasses.replace(cfg, n_layers=1)


# Values narrower than queries and keys (6 vs 14; 16 vs 32 for the GPU kernel's power-of-two tiles) run unpadded
# through every implementation. The interpreted Pallas kernel and the ring compile slowly: one layer each.
@pytest.mark.parametrize("impl", ["blockwise", "pallas", "ring"])
def test_every_attention_implementation_takes_the_narrower_values(tiny_config, impl):
  cfg = _one_layer(mla_like(tiny_config, rope=8, nope=24, v=16) if impl == "pallas" else mla_like(tiny_config))
  assert cfg.v_head_dim < cfg.qk_head_dim
  params = init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)

  def loss(p, impl):
    logits = forward(p, tokens, dataclasses.replace(cfg, attention_impl=impl))
    return logits.sum(), logits

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (_, want), g_want = grad(params, "xla")
  context = contextlib.ExitStack()
  if impl == "pallas":
    context.enter_context(interpret_pallas())
  if impl == "ring":
    context.enter_context(jax.set_mesh(make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, seq=8))))
  with context:
    (_, got), g_got = grad(params, impl)
  np.testing.assert_allclose(got, want, atol=LOGITS_TOL, rtol=LOGITS_TOL)
  jax.tree.map(lambda a, b: assert_close_to_scale(a, b, GRADS_REL), g_got, g_want)


def test_the_absorbed_decode_over_a_latent_cache_gives_the_naive_forwards_logits(tiny_config):
  cfg = mla_like(tiny_config)  # latent 12 + rotary key 4; 8 heads of query/key 14 and values 6
  params = init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
  want = forward(params, tokens, cfg)
  step = jax.jit(forward_with_cache, static_argnames=("cfg",))

  def prefill_then_decode(cache):
    logits, cache = step(params, tokens[:, :8], cfg, cache, positions=positions[:, :8])
    out = [logits]
    for t in range(8, 12):
      logits, cache = step(params, tokens[:, t:t + 1], cfg, cache, positions=positions[:, t:t + 1])
      out.append(logits)
    return jnp.concatenate(out, axis=1)

  exact = kv_cache.init_cache(cfg, 2, 16)
  # One KV head: the latent and the rotary key, no values (they are its first 12 columns).
  assert exact.k[0].shape == (2, 1, 16, 12 + 4) and exact.v is None and exact.v_scale is None
  # The same scores and outputs re-associated (W_UK on the query, W_UV after attention), float32: 1.2e-6 seen on
  # logits of scale 3.
  np.testing.assert_allclose(prefill_then_decode(exact), want, atol=LOGITS_TOL, rtol=LOGITS_TOL)
  # Int8 latents round each element by up to absmax / 254 of its slot: 0.017 seen; a wrong scale moves logits by
  # whole units.
  np.testing.assert_allclose(prefill_then_decode(kv_cache.init_cache(cfg, 2, 16, int8=True)), want, atol=0.1)


def test_grpo_samples_through_the_latent_cache_and_its_trainer_agrees(tiny_config):
  # DeepSeek's shape in miniature: MLA and experts, one layer. The sampler decodes in the absorbed form, the update
  # scores in the naive one; float32 log-probs of the same tokens agree to rounding.
  cfg = mla_like(moe_like(grpo_steps.MODEL, shared_mlp_dim=0))
  rl = Config(model=cfg, data=dataclasses.replace(Config().data, kind="rl", pack=False))
  config_rules.check(rl, "grpo")  # a GRPO job of an MLA model passes the checks every Job builder runs
  grpo = GRPOConfig(group_size=2, beta=0.04, sampling=SamplingConfig(temperature=0.8), max_staleness=0)
  _, history = grpo_steps.build(cfg, grpo, grpo_steps.even_tokens).run(1)
  assert np.isfinite(history[0]["loss"]) and history[0]["rollout/logp_diff_max"] < 1e-5, history[0]


def test_the_memory_floor_counts_queries_and_keys_at_their_width_and_values_at_theirs(tiny_config):
  cfg = mla_like(tiny_config)  # H = N heads, query/key width 4 + 10, value width 6
  wide_values = mla_like(tiny_config, v=14)  # values as wide as queries and keys: 14-wide heads throughout
  got, wide = (training_floor_bytes(c, batch=2, seq_len=8, seq_shards=1) for c in (cfg, wide_values))
  tokens, act, H = 16, 4, cfg.n_heads  # float32 activations
  assert wide["layer"] - got["layer"] == tokens * act * 2 * H * (14 - 6)  # v and out
  assert wide["kv_blocks"] - got["kv_blocks"] == tokens * (14 - 6) * (2 * act + 2 * 4)  # one head per pass
