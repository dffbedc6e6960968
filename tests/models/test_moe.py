"""Mixture-of-Experts MLPs: routing, the implementations against the dense reference, statistics, the decoder."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_variants import moe_like
from ptx import sharding
from ptx.config import MeshConfig
from ptx.model_config import MoeConfig
from ptx.models import init_params, moe
from ptx.models.decoder import forward
from ptx.models.params import param_specs

# Ragged and dense run the same float32 products, summed in another order (a grouped matmul's rows vs an einsum
# over every expert). Gradients of expert and router weights sum over every token, entries up to ~40 here: each
# implementation lies up to 1.7e-6 of a leaf's largest entry from the float64 gradient, and they differ from each
# other by up to 7.7e-7 of it (seen). So: rtol 1e-5, and an atol of 5e-6 of the leaf's largest entry.
IMPL_RTOL = 1e-5


def assert_close(got, want):
  """Leaf by leaf, to float32 summation-order tolerance (above)."""
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=IMPL_RTOL, atol=5e-6 * float(np.abs(b).max())),
               got, want)

MOE = MoeConfig(n_experts=6, experts_per_token=2, expert_mlp_dim=16, router_bias=True)


def _layer(cfg, seed=0):
  """One MoE layer's parameters (the first of a stack), perturbed so the router bias matters."""
  layer = jax.tree.map(lambda w: w[0], init_params(cfg, jax.random.key(seed))["layers"])
  keys = jax.random.split(jax.random.key(seed + 1), len(layer))
  return {name: w + 0.3 * jax.random.normal(key, w.shape) for (name, w), key in zip(sorted(layer.items()), keys)}


@pytest.fixture
def moe_cfg(tiny_config):
  return moe_like(tiny_config, shared_mlp_dim=0)


def _mlp(p, h, cfg, impl, mask=None):
  mask = jnp.ones(h.shape[:2], bool) if mask is None else mask
  return moe.moe_mlp(p, h, dataclasses.replace(cfg, moe_impl=impl), token_mask=mask, rules=sharding.DEFAULT_RULES)


def test_routing_is_hf_softmax_top_k_renormalised():
  """Qwen3-MoE's and Mixtral's rule, written in numpy: softmax over experts, k largest, divided by their sum."""
  logits = np.asarray(jax.random.normal(jax.random.key(0), (2, 5, 6)), np.float32) * 2
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ids = np.argsort(-probs, axis=-1)[..., :2]
  top = np.take_along_axis(probs, ids, -1)
  for norm, want in ((True, top / top.sum(-1, keepdims=True)), (False, top)):
    routes = moe.route(jnp.asarray(logits), dataclasses.replace(MOE, norm_topk_prob=norm))
    np.testing.assert_array_equal(routes.ids, ids)
    np.testing.assert_allclose(routes.weights, want, rtol=1e-6)  # float32 softmax vs numpy's: an ulp or two


@pytest.mark.parametrize("shared", [0, 24])
def test_ragged_equals_dense_forward_and_gradients(moe_cfg, shared):
  cfg = dataclasses.replace(moe_cfg, moe=dataclasses.replace(moe_cfg.moe, shared_mlp_dim=shared))
  p = _layer(cfg)
  h = jax.random.normal(jax.random.key(2), (3, 7, cfg.d_model))
  loss = lambda impl: jax.jit(jax.value_and_grad(lambda p, h: jnp.sum(jnp.sin(_mlp(p, h, cfg, impl)[0])),
                                                 argnums=(0, 1)))
  (want, want_grads), (got, got_grads) = loss("dense")(p, h), loss("ragged")(p, h)
  assert_close((got, got_grads), (want, want_grads))
  assert float(jnp.abs(got_grads[0]["router"]).sum()) > 0  # the router learns through the gate weights
  assert float(jnp.abs(got_grads[0]["router_bias"]).sum()) > 0


def test_dense_reference_is_the_routed_sum_of_expert_mlps(moe_cfg):
  """The reference itself, token by token: sum over the k chosen experts of weight * down(silu(gate) * up)."""
  p = _layer(moe_cfg)
  h = jax.random.normal(jax.random.key(3), (2, 4, moe_cfg.d_model))
  y, _, _, _ = _mlp(p, h, moe_cfg, "dense")
  routes = moe.route(moe.router_logits(p, h), moe_cfg.moe)
  h, ids, weights = np.asarray(h), np.asarray(routes.ids), np.asarray(routes.weights)
  want = np.zeros_like(h)
  for b, t in np.ndindex(*h.shape[:2]):
    for e, w in zip(ids[b, t], weights[b, t]):
      gate, up = h[b, t] @ np.asarray(p["expert_gate"][e]), h[b, t] @ np.asarray(p["expert_up"][e])
      want[b, t] += w * ((gate / (1 + np.exp(-gate)) * up) @ np.asarray(p["expert_down"][e]))
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)  # float32 vs numpy's summation order


@pytest.mark.parametrize("axes", [dict(data=2, fsdp=2, tensor=2), dict(data=1, fsdp=4, tensor=2),
                                  dict(data=2, fsdp=1, tensor=1, seq=4)],
                         ids=["data2_fsdp2_tensor2", "fsdp4_tensor2", "data2_seq4"])
def test_implementations_on_eight_devices_equal_one_device(moe_cfg, axes):
  """Tokens over data/fsdp/seq, expert hidden units over tensor: the same forward and gradients as on one device."""
  p = _layer(moe_cfg)
  h = jax.random.normal(jax.random.key(4), (4, 8, moe_cfg.d_model))
  want = jax.jit(jax.value_and_grad(lambda p: jnp.sum(jnp.sin(_mlp(p, h, moe_cfg, "dense")[0]))))(p)
  mesh = sharding.make_mesh(MeshConfig(**{"seq": 1, **axes}))
  layer_axes = {name: spec.logical_axes[1:] for name, spec in param_specs(moe_cfg)["layers"].items()}
  placed = jax.device_put(p, sharding.named_shardings(layer_axes, p, mesh))
  tokens = jax.device_put(h, sharding.batch_sharding(mesh, 3))
  for impl in ("dense", "ragged"):
    with jax.set_mesh(mesh):
      got = jax.jit(jax.value_and_grad(lambda p, h: jnp.sum(jnp.sin(_mlp(p, h, moe_cfg, impl)[0]))))(placed, tokens)
    assert_close(got, want)


def gpt_oss_experts(cfg):
  """`cfg` with gpt-oss's experts: a bias on each projection, the SwiGLU clamped (at 1: these weights pass it)."""
  return dataclasses.replace(cfg, activation="clamped_swiglu", swiglu_limit=1.0,
                             moe=dataclasses.replace(cfg.moe, expert_bias=True))


def test_expert_biases_and_the_clamped_swiglu_agree_in_every_implementation(moe_cfg):
  """Ragged adds each sorted copy's bias rows, dense each expert's; with hidden units over tensor the down
  projection's bias is added on one slice only, so that the sum over tensor counts it once."""
  cfg = gpt_oss_experts(moe_cfg)
  p = _layer(cfg)
  h = jax.random.normal(jax.random.key(4), (4, 8, cfg.d_model))
  loss = lambda impl: jax.jit(jax.value_and_grad(lambda p, h: jnp.sum(jnp.sin(_mlp(p, h, cfg, impl)[0]))))
  want = loss("dense")(p, h)
  for name in ("expert_gate_bias", "expert_up_bias", "expert_down_bias"):  # every expert's biases learn
    assert float(jnp.abs(want[1][name]).sum(axis=-1).min()) > 0, name
  assert_close(loss("ragged")(p, h), want)
  mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=4, tensor=2, seq=1))
  layer_axes = {name: spec.logical_axes[1:] for name, spec in param_specs(cfg)["layers"].items()}
  placed = jax.device_put(p, sharding.named_shardings(layer_axes, p, mesh))
  assert placed["expert_gate_bias"].sharding.spec[1] == "tensor"
  for impl in ("dense", "ragged"):
    with jax.set_mesh(mesh):
      assert_close(loss(impl)(placed, jax.device_put(h, sharding.batch_sharding(mesh, 3))), want)


def test_biases_and_sinks_are_not_decayed_and_idle_experts_biases_are_not_active(moe_cfg):
  from ptx.models.params import count_active_params, count_params, weight_decay_mask

  cfg = dataclasses.replace(gpt_oss_experts(moe_cfg), o_bias=True, attention_sinks=True)
  decay = weight_decay_mask(cfg)["layers"]
  assert decay["expert_gate"] and decay["expert_down"] and decay["o"]
  assert not any(decay[name] for name in ("expert_gate_bias", "expert_up_bias", "expert_down_bias", "o_bias",
                                          "sinks"))
  D, F, idle = cfg.d_model, cfg.moe.expert_mlp_dim, cfg.moe.n_experts - cfg.moe.experts_per_token
  assert count_active_params(cfg) == count_params(cfg) - cfg.n_layers * idle * (3 * D * F + 2 * F + D)


def test_ragged_on_a_mesh_sorts_each_devices_tokens_in_place(moe_cfg):
  """No collective moves tokens: with tokens over data and experts whole, the ragged forward has no all-gather."""
  p = _layer(moe_cfg)
  h = jax.random.normal(jax.random.key(5), (8, 6, moe_cfg.d_model))
  mesh = sharding.make_mesh(MeshConfig(data=8, fsdp=1, tensor=1, seq=1))
  tokens = jax.device_put(h, sharding.batch_sharding(mesh, 3))
  with jax.set_mesh(mesh):
    hlo = jax.jit(lambda p, h: _mlp(p, h, moe_cfg, "ragged")[0]).lower(p, tokens).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_statistics_count_only_the_masked_tokens():
  """Perfect balance gives a load ratio and balance loss of 1; masked tokens count for nothing."""
  E = 4
  # Token t prefers expert t % 4 then (t + 1) % 4: every expert takes two of 8 copies over 4 tokens.
  logits = jnp.asarray([[[5.0 if e == t % E else 4.0 if e == (t + 1) % E else 0.0 for e in range(E)]
                         for t in range(6)]])
  cfg = MoeConfig(n_experts=E, experts_per_token=2, expert_mlp_dim=3)
  routes = moe.route(logits, cfg)
  mask = jnp.asarray([[True] * 4 + [False] * 2])
  stats = moe.statistics(logits, routes, mask, cfg)
  assert float(stats["load_max_over_mean"]) == pytest.approx(1.0)
  probs = jax.nn.softmax(logits[0, :4], axis=-1)
  assert float(stats["balance_loss"]) == pytest.approx(float(E * jnp.sum(0.25 * probs.mean(0))), rel=1e-6)
  assert float(stats["balance_loss"]) == pytest.approx(1.0, rel=1e-6)  # uniform mean probabilities too
  lse = jax.nn.logsumexp(logits[0, :4], axis=-1)
  assert float(stats["z_loss"]) == pytest.approx(float(jnp.mean(lse ** 2)), rel=1e-6)
  entropy = -jnp.sum(probs * jnp.log(probs), axis=-1).mean()
  assert float(stats["router_entropy"]) == pytest.approx(float(entropy), rel=1e-6)
  unbalanced = moe.statistics(logits, routes, jnp.asarray([[True, False, False, False, False, False]]), cfg)
  assert float(unbalanced["load_max_over_mean"]) == pytest.approx(2.0)  # one token: 2 experts of 4 take a copy


def test_moe_decoder_implementations_agree_and_padding_changes_nothing(moe_cfg):
  params = init_params(moe_cfg, jax.random.key(6))
  tokens = jax.random.randint(jax.random.key(7), (2, 9), 0, moe_cfg.vocab_size)
  run = jax.jit(forward, static_argnames=("cfg",))
  dense_logits = run(params, tokens, moe_cfg)
  ragged_logits = run(params, tokens, dataclasses.replace(moe_cfg, moe_impl="ragged"))
  assert_close(ragged_logits, dense_logits)
  segments = jnp.asarray([[1] * 6 + [0] * 3] * 2)  # a padded tail: MoE layers route each token alone
  padded = run(params, tokens, moe_cfg, segment_ids=segments)
  np.testing.assert_allclose(padded[:, :6], run(params, tokens[:, :6], moe_cfg), rtol=1e-5, atol=1e-5)


def test_config_refuses_impossible_routing():
  with pytest.raises(ValueError, match="model.moe.experts_per_token"):
    MoeConfig(n_experts=4, experts_per_token=5, expert_mlp_dim=8)
  with pytest.raises(ValueError, match="model.moe.expert_mlp_dim"):
    MoeConfig(n_experts=4)
  with pytest.raises(ValueError, match="model.moe_impl"):
    moe.resolve_impl("megablox")


def test_lora_targets_a_moe_model_has_and_refuses_the_rest(moe_cfg):
  from ptx.config import LoRAConfig
  from ptx.models import lora

  with pytest.raises(ValueError, match=r"lora.targets: \['gate', 'up', 'down'\] are not weights of this model"):
    lora.adapter_specs(moe_cfg, LoRAConfig(rank=2))
  shared = moe_like(moe_cfg)  # with shared experts, whose gate/up/down take adapters
  assert set(lora.adapter_specs(shared, LoRAConfig(rank=2))) == {"q", "k", "v", "o", "gate", "up", "down"}


def test_fast_mode_rollout_tree_keeps_the_experts_float(moe_cfg):
  from ptx.models.rollout_params import rollout_params
  import qwix

  params = init_params(moe_cfg, jax.random.key(8))
  rollout = rollout_params(params, moe_cfg)
  assert isinstance(rollout["layers"]["q"], qwix.QArray)
  for name in ("router", "router_bias", "expert_gate", "expert_up", "expert_down"):
    assert rollout["layers"][name] is params["layers"][name]
  tokens = jax.random.randint(jax.random.key(9), (2, 5), 0, moe_cfg.vocab_size)
  # The int8 tree runs as its dequantised float twin: the experts see what the attention's int8 weights produce.
  twin = jax.tree.map(lambda w: qwix.dequantize(w) if isinstance(w, qwix.QArray) else w, rollout,
                      is_leaf=lambda w: isinstance(w, qwix.QArray))
  # The same products, the int8 one dequantised inside the dot: float32 rounding of logits O(1).
  np.testing.assert_allclose(forward(rollout, tokens, moe_cfg), forward(twin, tokens, moe_cfg), rtol=1e-5, atol=1e-5)


def test_sft_loss_adds_the_weighted_auxiliary_losses_and_logs_every_layer(moe_cfg):
  from ptx.algorithms import sft
  from ptx.models.chunked_logits import token_stats

  params = init_params(moe_cfg, jax.random.key(10))
  tokens = jax.random.randint(jax.random.key(11), (2, 8), 0, moe_cfg.vocab_size)
  batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens), "positions": jnp.broadcast_to(jnp.arange(8), (2, 8)),
           "segment_ids": jnp.asarray([[1] * 8, [1] * 5 + [0] * 3])}
  off, metrics = sft.loss(params, batch, None, model=moe_cfg)  # off by default: the cross-entropy alone
  assert float(off) == pytest.approx(float(metrics["loss"]))
  assert {f"moe/layer{i:02d}/load_max_over_mean" for i in range(moe_cfg.n_layers)} <= set(metrics)
  stats = token_stats(params, tokens, moe_cfg, positions=batch["positions"], segment_ids=batch["segment_ids"])[1].stats
  assert stats["balance_loss"].shape == (moe_cfg.n_layers,)
  np.testing.assert_allclose(metrics["moe/balance_loss"], jnp.mean(stats["balance_loss"]), rtol=1e-6)
  weighted = dataclasses.replace(moe_cfg, moe_balance_coef=0.01, moe_z_coef=0.001)
  on, _ = sft.loss(params, batch, None, model=weighted)
  want = off + 0.01 * jnp.mean(stats["balance_loss"]) + 0.001 * jnp.mean(stats["z_loss"])
  assert float(on) == pytest.approx(float(want), rel=1e-6)
  # The balance loss alone moves the router: its gradient with the cross-entropy's removed is non-zero.
  grad = lambda cfg: jax.grad(lambda p: sft.loss(p, batch, None, model=cfg)[0])(params)["layers"]["router"]
  assert float(jnp.abs(grad(weighted) - grad(moe_cfg)).max()) > 0


SIGMOID = MoeConfig(n_experts=8, experts_per_token=3, expert_mlp_dim=16, router="sigmoid", n_groups=4, topk_groups=2,
                    routed_scale=2.5)


def test_sigmoid_group_limited_routing_equals_transformers_deepseek_v3_router():
  """The peer's own code: transformers' DeepseekV3TopkRouter, its weight and correction bias randomised."""
  torch = pytest.importorskip("torch", reason="the reference router needs torch (installed by `make test`)")
  deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
  config = deepseek.DeepseekV3Config(hidden_size=40, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                     topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
  reference = deepseek.DeepseekV3TopkRouter(config)
  torch.manual_seed(0)
  with torch.no_grad():
    reference.weight.copy_(torch.randn_like(reference.weight))
    reference.e_score_correction_bias.copy_(torch.randn(8) * 0.5)  # large enough to change which experts win
  h = np.random.default_rng(0).standard_normal((24, 40)).astype(np.float32)
  with torch.no_grad():
    _, want_weights, want_ids = (t.numpy() for t in reference(torch.from_numpy(h)))
  for norm in (True, False):
    reference.norm_topk_prob = norm
    with torch.no_grad():
      _, want_weights, want_ids = (t.numpy() for t in reference(torch.from_numpy(h)))
    p = {"router": jnp.asarray(reference.weight.detach().numpy().T)}
    routes = moe.route(moe.router_logits(p, jnp.asarray(h)[None]), dataclasses.replace(SIGMOID, norm_topk_prob=norm),
                       jnp.asarray(reference.e_score_correction_bias.numpy()))
    # torch's top-k here is unsorted: compare each token's experts as sorted pairs. The weights: the logits (up to
    # ~10) come from torch's matmul and XLA's, an ulp (9.5e-7) apart, which moves a sigmoid's tail by that much
    # relative (seen 1.005e-6).
    order = np.argsort(want_ids, axis=-1)
    np.testing.assert_array_equal(np.sort(routes.ids[0], axis=-1), np.take_along_axis(want_ids, order, -1))
    got_order = np.argsort(np.asarray(routes.ids[0]), axis=-1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(routes.weights[0]), got_order, -1),
                               np.take_along_axis(want_weights, order, -1), rtol=1e-5)
  biased = moe.route(moe.router_logits(p, jnp.asarray(h)[None]), SIGMOID, jnp.zeros(8))
  assert (np.sort(biased.ids, -1) != np.sort(routes.ids, -1)).any()  # the correction bias does choose


def test_a_sigmoid_routed_model_trains_every_weight_but_its_correction_bias(tiny_config):
  """The correction bias is a buffer: saved and sharded like a weight, never moved by the optimizer."""
  from ptx.config import OptimizerConfig
  from ptx.algorithms import sft
  from ptx.models.params import trainable_mask, weight_decay_mask
  from ptx.train.optimizer import make_optimizer
  import optax

  cfg = dataclasses.replace(tiny_config, moe=SIGMOID)
  assert trainable_mask(tiny_config) is None  # dense models keep their optimizer state as it was
  mask = trainable_mask(cfg)
  assert mask["layers"]["router_correction"] is False and mask["layers"]["router"] is True
  params = init_params(cfg, jax.random.key(12))
  params["layers"]["router_correction"] = jax.random.normal(jax.random.key(13), (cfg.n_layers, 8))
  optimizer = make_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0), 10, weight_decay_mask(cfg),
                             mask)
  tokens = jax.random.randint(jax.random.key(14), (2, 8), 0, cfg.vocab_size)
  batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens), "segment_ids": jnp.ones_like(tokens),
           "positions": jnp.broadcast_to(jnp.arange(8), (2, 8))}
  grads = jax.grad(lambda p: sft.loss(p, batch, None, model=cfg)[0])(params)
  assert float(jnp.abs(grads["layers"]["router_correction"]).max()) == 0  # it only chooses: no gradient reaches it
  # Were one to reach it (a frozen tower's would), the optimizer still would not move it; without the mask it would.
  # Weight decay (0.1 here) does not touch it either.
  grads["layers"]["router_correction"] = jnp.ones_like(params["layers"]["router_correction"])
  state = optimizer.init(params)
  updates, _ = optimizer.update(grads, state, params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(new["layers"]["router_correction"], params["layers"]["router_correction"])
  assert float(jnp.abs(new["layers"]["router"] - params["layers"]["router"]).max()) > 0
  plain = make_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0), 10, weight_decay_mask(cfg))
  moved, _ = plain.update(grads, plain.init(params), params)
  assert float(jnp.abs(moved["layers"]["router_correction"]).max()) > 0


def test_sigmoid_routed_implementations_agree(tiny_config):
  cfg = dataclasses.replace(tiny_config, moe=SIGMOID)
  p = _layer(cfg)
  h = jax.random.normal(jax.random.key(15), (2, 5, cfg.d_model))
  loss = lambda impl: jax.jit(jax.value_and_grad(lambda p: jnp.sum(jnp.sin(_mlp(p, h, cfg, impl)[0]))))(p)
  want, got = loss("dense"), loss("ragged")
  assert_close(got, want)
  assert float(jnp.abs(got[1]["router"]).sum()) > 0  # gate weights are the scores: the router learns
  assert float(jnp.abs(got[1]["router_correction"]).max()) == 0  # the bias only chooses


def test_a_run_whose_model_no_hf_family_expresses_is_refused_before_it_trains(tmp_path, capsys):
  from ptx import cli

  out = tmp_path / "run"
  args = ["sft", "--model=tiny", "--model.moe.n_experts=4", "--model.moe.expert_mlp_dim=8",
          "--model.moe.router=sigmoid", f"--out={out}", '--data.train_files=["absent.jsonl"]']
  with pytest.raises(SystemExit) as refused:
    cli.main(args)
  assert refused.value.code == 2 and not out.exists()
  assert "OUT/hf cannot hold this model (mixtral needs model.moe.router='softmax'" in capsys.readouterr().err


def test_bfloat16_experts_stay_near_float32(moe_cfg):
  """bf16 weights and activations through both implementations: float32 routing, bf16 products."""
  p = _layer(moe_cfg)
  h = jax.random.normal(jax.random.key(16), (2, 6, moe_cfg.d_model))
  want = _mlp(p, h, moe_cfg, "dense")[0]
  low = dataclasses.replace(moe_cfg, compute_dtype="bfloat16")
  for impl in ("dense", "ragged"):
    got = _mlp(jax.tree.map(lambda w: w.astype(jnp.bfloat16), p), h.astype(jnp.bfloat16), low, impl)[0]
    assert got.dtype == jnp.bfloat16
    # bf16 keeps 8 bits of mantissa: products and sums of O(1) values within a few percent of float32 (seen 0.68%);
    # a token whose two best experts tie within bf16 rounding could route elsewhere, none here.
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) < 0.05 * float(jnp.abs(want).max())


def test_the_memory_floor_counts_the_experts_a_token_runs_through(moe_cfg):
  from ptx.models.memory_floor import training_floor_bytes

  dense = dataclasses.replace(moe_cfg, moe=MoeConfig(), mlp_dim=2 * 16 + 24)  # k x expert width + shared width
  shared = moe_like(moe_cfg)
  floor = lambda cfg: training_floor_bytes(cfg, batch=2, seq_len=64, seq_shards=1)["layer"]
  assert floor(shared) == floor(dense)
