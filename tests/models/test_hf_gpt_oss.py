"""gpt-oss (attention sinks, q/k/v/o biases, sliding and full layers, YaRN, biased experts fused in the checkpoint,
a clamped SwiGLU) against transformers.

A tiny GptOssForCausalLM with every weight redrawn (biases, sinks, the router's bias and the norms included; a
fresh model has zero expert biases) and a swiglu_limit low enough that the clamps bite, saved by transformers, loaded
by ptx: logits within 1e-4 of transformers' in float32, as tests/models/test_hf.py asks of every family, and every
weight's gradient as torch's autograd gives it; saved back, the directory holds transformers' own tensors bit for bit
(gate and up interleaved again) and loads in both; loaded onto 8 devices with the experts split over `expert`, it
computes the same logits through the expert-parallel layer; decoding through the KV cache gives the same logits and
transformers' greedy tokens. The hub's MXFP4 experts load to transformers' logits too.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_parity import hf_logits, ptx_logits, randomize
from ptx.config import MeshConfig
from ptx.model_config import MODEL_PRESETS, ModelConfig
from ptx.models import Decoder, forward, hf_config, load_hf, moe, save_hf
from ptx.models.decoder import forward_with_cache
from ptx.models.gated_mlp import Activation, gated_activation
from ptx.models.kv_cache import init_cache
from ptx.models.params import count_active_params, param_shardings
from ptx.sharding import make_mesh

torch = pytest.importorskip("torch", reason="HF parity tests need torch (installed by `make test`)")
transformers = pytest.importorskip("transformers", reason="HF parity tests need transformers (`make test`)")

pytestmark = pytest.mark.slow

T = 24  # past the sliding window (5) and YaRN's original context (16)
# Pairwise distinct widths: d_model 40, 8 heads of 14, 2 kv heads, experts 16 wide, 8 experts (4 per device on the
# expert mesh below), 3 per token. swiglu_limit 0.5: the gate and up projections of these weights pass it.
_CONFIG = dict(vocab_size=264, hidden_size=40, intermediate_size=16, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, head_dim=14, num_local_experts=8, num_experts_per_tok=3, sliding_window=5,
               rms_norm_eps=1e-6, max_position_embeddings=64, swiglu_limit=0.5, tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(directory, tokens, transformers logits) of a saved tiny random gpt-oss."""
  config = transformers.GptOssConfig(**_CONFIG)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  randomize(model, 0)
  with torch.no_grad():
    for layer in model.model.layers:  # sinks of O(1), as trained ones are, so that they matter
      layer.self_attn.sinks.copy_(torch.randn(config.num_attention_heads))
  path = tmp_path_factory.mktemp("gpt_oss")
  model.save_pretrained(path)
  tokens = np.random.default_rng(1).integers(0, _CONFIG["vocab_size"], (2, T))
  return path, tokens, hf_logits(model, tokens)


def test_load_matches_transformers(checkpoint):
  path, tokens, expected = checkpoint
  model = load_hf(path)
  cfg = model.cfg
  assert (cfg.qkv_bias, cfg.o_bias, cfg.attention_sinks, cfg.activation, cfg.swiglu_limit) == (
      True, True, True, "clamped_swiglu", 0.5)
  assert (cfg.sliding_window, cfg.sliding_window_pattern) == (5, 2)  # layers 0 and 2 slide, as layer_types says
  assert (cfg.rope_scaling.kind, cfg.rope_scaling.truncate, cfg.rope_scaling.factor) == ("yarn", False, 4.0)
  assert (cfg.moe.n_experts, cfg.moe.experts_per_token, cfg.moe.expert_mlp_dim) == (8, 3, 16)
  assert cfg.moe.router_bias and cfg.moe.expert_bias and cfg.moe.norm_topk_prob
  assert float(jnp.abs(model.params["layers"]["expert_up_bias"]).min()) > 0  # read, not left at zero
  # HF parity in float32, as tests/models/test_hf.py: reordered float32 sums through 4 layers, logits of O(1).
  np.testing.assert_allclose(ptx_logits(model, tokens), expected, atol=1e-4, rtol=0)


def test_save_hf_writes_transformers_tensors_and_loads_back_bit_exact(checkpoint, tmp_path):
  path, tokens, expected = checkpoint
  model = load_hf(path)
  save_hf(model, tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert (config["model_type"], config["swiglu_limit"], config["attention_bias"]) == ("gpt_oss", 0.5, True)
  assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
  np.testing.assert_allclose(hf_logits(reloaded.eval(), tokens), expected, atol=1e-4, rtol=0)
  reloaded_ptx = load_hf(tmp_path)
  assert reloaded_ptx.cfg == model.cfg
  jax.tree.map(np.testing.assert_array_equal, reloaded_ptx.params, model.params)  # load -> save -> load: bit-exact
  from safetensors.numpy import load_file

  ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(path / "model.safetensors")
  assert ours.keys() == theirs.keys()
  for key in ours:  # gate and up interleaved again, the experts fused: every tensor as transformers wrote it
    np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_gradients_match_transformers(checkpoint, tmp_path):
  """Every weight's gradient of a loss on the logits, in HF's names and layout (written by save_hf), against torch's
  autograd: the sinks', the biases', the router's through its top-k softmax, the clamped SwiGLU's backward."""
  path, tokens, expected = checkpoint
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
  probe = np.random.default_rng(2).normal(size=expected.shape).astype(np.float32)
  (hf(torch.tensor(tokens)).logits * torch.tensor(probe)).sum().backward()
  model = load_hf(path)
  loss = lambda params: jnp.sum(forward(params, jnp.asarray(tokens, jnp.int32), model.cfg) * probe)
  save_hf(Decoder(model.cfg, params=jax.grad(loss)(model.params)), tmp_path)
  from safetensors.numpy import load_file

  ours = load_file(tmp_path / "model.safetensors")
  assert ours.keys() == {name for name, _ in hf.named_parameters()}
  for name, p in hf.named_parameters():
    want = p.grad.numpy()
    # Sums over 48 tokens and 4 layers in float32, in another order: 1e-4 of the leaf's largest entry, as the
    # expert-parallel tests bound a gradient.
    np.testing.assert_allclose(ours[name], want, rtol=0, atol=1e-4 * float(np.abs(want).max()), err_msg=name)


def test_loads_with_the_experts_split_over_expert_and_runs_them_expert_parallel(checkpoint):
  path, tokens, expected = checkpoint
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, expert=4, tensor=2))
  model = load_hf(path, mesh=mesh)
  for (where, array), sharding in zip(jax.tree_util.tree_leaves_with_path(model.params),
                                      jax.tree.leaves(param_shardings(model.cfg, mesh))):
    assert array.sharding == sharding, where
  for name in ("expert_gate", "expert_up_bias", "expert_down_bias"):
    assert model.params["layers"][name].sharding.spec[1] == "expert", name  # 2 of the 8 experts per device
  gate = model.params["layers"]["expert_gate"]
  assert gate.sharding.shard_shape(gate.shape)[1:] == (2, 40, 8)  # and half of each expert's hidden units
  unsharded = ptx_logits(load_hf(path), tokens)
  with jax.set_mesh(mesh):
    assert moe.resolve_impl(model.cfg.moe_impl) == "expert_parallel"
    got = ptx_logits(model, tokens)
  # Sharded vs one device: float32 sums over devices in another order, logits of O(1).
  np.testing.assert_allclose(got, unsharded, atol=1e-5, rtol=0)
  np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)  # HF parity, as above


def test_an_mxfp4_checkpoint_gives_transformers_logits(tmp_path):
  """The hub's form: the experts as MXFP4 blocks and scales (quantization_config "mxfp4"), dequantised by ptx's
  loader and by transformers' (dequantize=True) into the fused layout: the same logits."""
  from safetensors.numpy import load_file, save_file

  # Widths that are multiples of MXFP4's blocks of 32: gate_up_proj contracts D = 64, down_proj F = 32.
  D, F, E = 64, 32, _CONFIG["num_local_experts"]
  config = transformers.GptOssConfig(**{**_CONFIG, "hidden_size": D, "intermediate_size": F, "num_hidden_layers": 2})
  randomize(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"), 0).save_pretrained(
      tmp_path)
  tensors, rng = load_file(tmp_path / "model.safetensors"), np.random.default_rng(4)
  for i in range(config.num_hidden_layers):
    for name, rows, contracted in (("gate_up_proj", 2 * F, D), ("down_proj", D, F)):
      stem = f"model.layers.{i}.mlp.experts.{name}"
      del tensors[stem]  # blocks [E, rows, contracted / 32, 16] of random codes, scales 2^-9 .. 2^-4
      tensors[stem + "_blocks"] = rng.integers(0, 256, (E, rows, contracted // 32, 16), dtype=np.uint8)
      tensors[stem + "_scales"] = rng.integers(118, 124, (E, rows, contracted // 32), dtype=np.uint8)
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  hf = json.loads((tmp_path / "config.json").read_text())
  hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                    "model.layers.*.mlp.router",
                                                                                    "model.embed_tokens", "lm_head"]}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
      attn_implementation="eager")
  tokens = np.random.default_rng(1).integers(0, _CONFIG["vocab_size"], (2, T))
  # HF parity in float32, as above (the dequantised weights are exact in both).
  np.testing.assert_allclose(ptx_logits(load_hf(tmp_path), tokens), hf_logits(theirs.eval(), tokens), atol=1e-4,
                             rtol=0)


def test_decoding_through_the_kv_cache_attends_with_the_sinks(checkpoint):
  """Prefill 8 tokens, then one at a time through the KV cache, past the sliding window: the full forward's logits
  (HF's, to HF parity); and fed its own argmax, the cache continues the prompts as transformers' greedy `generate`."""
  path, tokens, expected = checkpoint
  model, prompt = load_hf(path), 8
  step = jax.jit(functools.partial(forward_with_cache, cfg=model.cfg))

  def decode(feed):
    """Logits [2, T, V] of the prompt and then of `feed(t, logits of token t - 1)`'s token at each position t."""
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    logits, cache = step(model.params, jnp.asarray(tokens[:, :prompt], jnp.int32), cache=init_cache(model.cfg, 2, T),
                         positions=positions[:, :prompt])
    out = [logits]
    for t in range(prompt, T):
      logits, cache = step(model.params, feed(t, logits[:, -1]), cache=cache, positions=positions[:, t:t + 1])
      out.append(logits)
    return np.asarray(jnp.concatenate(out, axis=1))

  # HF parity, as above (the cache's softmax sums its slots in another order than the forward's).
  np.testing.assert_allclose(decode(lambda t, _: jnp.asarray(tokens[:, t:t + 1], jnp.int32)), expected, atol=1e-4,
                             rtol=0)
  greedy = decode(lambda t, last: jnp.argmax(last, axis=-1)[:, None].astype(jnp.int32))
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
  with torch.no_grad():
    want = hf.generate(torch.tensor(tokens[:, :prompt]), do_sample=False, max_new_tokens=T - prompt + 1,
                       min_new_tokens=T - prompt + 1, pad_token_id=0).numpy()[:, prompt:]
  np.testing.assert_array_equal(np.argmax(greedy[:, prompt - 1:], axis=-1), want)


def test_router_is_transformers_top_k_of_logits_then_softmax():
  """gpt-oss's router (top-k of the logits, a softmax over those k) is ptx's softmax router renormalised."""
  config = transformers.GptOssConfig(**_CONFIG)
  router = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(config)
  randomize(router, 3, scale=1.0)
  with torch.no_grad():
    logits, want_weights, want_ids = router(torch.randn(64, _CONFIG["hidden_size"]))
  routes = moe.route(jnp.asarray(logits.numpy())[None], load_family_moe())
  np.testing.assert_array_equal(routes.ids[0], want_ids.numpy())  # the same experts, in the same order
  # Of the same float32 logits, two float32 softmaxes (over all E, renormalised over k, vs over the k): a few ulps.
  np.testing.assert_allclose(routes.weights[0], want_weights.numpy(), rtol=1e-6, atol=1e-7)


def load_family_moe():
  """The MoeConfig that the gpt_oss family reads from `_CONFIG`."""
  config = transformers.GptOssConfig(**_CONFIG).to_dict()
  return hf_config.model_config(config, hf_config.FAMILIES["gpt_oss"]).moe


def test_clamped_swiglu_is_transformers_apply_gate():
  """On gate and up values past the clamps (+-7) on both sides; its gradient: tests/models/test_decoder.py."""
  config = transformers.GptOssConfig(**{**_CONFIG, "swiglu_limit": 7.0})
  experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
  gate_up = torch.randn(5, 2 * 16) * 6
  want = experts._apply_gate(gate_up).numpy()
  gate, up = jnp.asarray(gate_up[:, ::2].numpy()), jnp.asarray(gate_up[:, 1::2].numpy())
  got = gated_activation(Activation("clamped_swiglu", 7.0), gate, up)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # float32 elementwise: an ulp or two


def test_refusals_name_the_field(checkpoint, tmp_path):
  path, _, _ = checkpoint
  config = json.loads((path / "config.json").read_text())
  for change, message in (({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5 is not supported"),
                          ({"attention_bias": False}, "attention_bias=false is not supported")):
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(hf_config.HFConfigError, match=message):
      load_hf(tmp_path)
  for field, value in (("o_bias", True), ("attention_sinks", True), ("activation", "clamped_swiglu")):
    with pytest.raises(hf_config.HFConfigError, match=f"model.{field}"):  # llama would drop it
      hf_config.hf_config(ModelConfig(**{field: value}), hf_config.FAMILIES["llama"])


# The model card's active counts, 3.61B and 5.13B, leave out the embedding table (a token reads one row of it) and
# count the output projection. (The totals, exact, are in tests/models/test_decoder.py.)
CARD_ACTIVE = {"gpt_oss_20b": 3.61e9, "gpt_oss_120b": 5.13e9}


@pytest.mark.parametrize("name", sorted(CARD_ACTIVE))
def test_presets_have_the_model_cards_active_parameter_counts(name):
  cfg = MODEL_PRESETS[name]()
  # The card rounds to 10M: 3.608B and 5.133B here.
  assert count_active_params(cfg) - cfg.vocab_size * cfg.d_model == pytest.approx(CARD_ACTIVE[name], rel=5e-3)
