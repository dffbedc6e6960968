"""Parity with HF transformers on tiny random checkpoints of every family.

Each checkpoint is made by transformers itself (`XxxForCausalLM(config)`,
weights redrawn so that biases and (1 + w) norms matter, `save_pretrained`),
then loaded by ptx; logits must match transformers' at 1e-4 in float32 on
sequences longer than the sliding window and the Llama 3.1 rope window.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_parity import hf_logits as _hf_logits
from hf_parity import ptx_logits as _ptx_logits
from hf_parity import randomize as _randomize
from ptx.config import MeshConfig
from ptx.models import hf_config, load_hf, save_hf
from ptx.models.hf_load import CheckpointError
from ptx.models.params import param_shardings
from ptx.sharding import make_mesh

torch = pytest.importorskip("torch", reason="HF parity tests need torch (installed by `make test`)")
transformers = pytest.importorskip("transformers", reason="HF parity tests need transformers (`make test`)")

pytestmark = pytest.mark.slow

T = 24  # longer than the sliding window (5) and the rope-scaling window (16)
_COMMON = dict(vocab_size=264, hidden_size=40, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, head_dim=14, rope_theta=10_000.0, rms_norm_eps=1e-6)
_GEMMA = dict(hidden_activation="gelu_pytorch_tanh", sliding_window=5, query_pre_attn_scalar=20)
FAMILIES = {
    "llama": ("llama", {}),
    "llama31_rope": ("llama", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", dict(_GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3_text": ("gemma3_text", dict(_GEMMA, sliding_window_pattern=3, rope_local_base_freq=100.0,
                                        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # Mixtures of Experts: 6 experts of width 16 (distinct from the model's other widths), 2 per token.
    "qwen3_moe": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                    norm_topk_prob=True)),
    "qwen3_moe_unnormalised": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16,
                                                 norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=16)),
    # Dense layers among the MoE layers: 0 (mlp_only_layers) and 2 ((i + 1) % decoder_sparse_step): dense, MoE,
    # dense, MoE, two stacks interleaved.
    "qwen3_moe_mixed": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                          norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=2)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
  """(name, directory, tokens, transformers logits) of a saved tiny random model."""
  model_type, extra = FAMILIES[request.param]
  config = transformers.CONFIG_MAPPING[model_type](**{**_COMMON, **extra})
  model = _randomize(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"), 0)
  path = tmp_path_factory.mktemp(request.param)
  # A small shard size makes transformers write an index and several files.
  model.save_pretrained(path, max_shard_size="40KB" if request.param in ("llama31_rope", "gemma2") else "50GB")
  tokens = np.random.default_rng(1).integers(0, _COMMON["vocab_size"], (2, T))
  return request.param, path, tokens, _hf_logits(model, tokens)


def test_load_matches_transformers(checkpoint):
  name, path, tokens, expected = checkpoint
  model = load_hf(path)
  np.testing.assert_allclose(_ptx_logits(model, tokens), expected, atol=1e-4, rtol=0, err_msg=name)


def test_config_maps_features(checkpoint):
  name, path, _, _ = checkpoint
  cfg = load_hf(path).cfg
  if name == "llama31_rope":
    assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.original_max_positions == 16
  if name == "gemma2":
    assert (cfg.sliding_window, cfg.sliding_window_pattern, cfg.attn_logit_softcap) == (5, 2, 5.0)
  if name == "gemma3_text":
    assert (cfg.sliding_window_pattern, cfg.rope_local_theta, cfg.rope_scaling.factor) == (3, 100.0, 4.0)
  if name == "qwen2":
    assert cfg.qkv_bias and cfg.tie_embeddings
  if name.startswith("qwen3_moe"):
    assert cfg.qk_norm and (cfg.moe.n_experts, cfg.moe.expert_mlp_dim) == (6, 16)
    assert cfg.moe.norm_topk_prob == (name != "qwen3_moe_unnormalised")
    assert cfg.moe.dense_layers == ((0, 2) if name == "qwen3_moe_mixed" else ())
  if name == "mixtral":
    assert (cfg.moe.n_experts, cfg.moe.experts_per_token, cfg.moe.expert_mlp_dim) == (6, 2, 16)


def test_save_hf_loads_in_transformers(checkpoint, tmp_path):
  name, path, tokens, expected = checkpoint
  model = load_hf(path)
  save_hf(model, tmp_path)  # then overwritten by a sharded save, which must not mix with it
  save_hf(model, tmp_path, max_shard_bytes=60_000)
  assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
  np.testing.assert_allclose(_hf_logits(reloaded.eval(), tokens), expected, atol=1e-4, rtol=0, err_msg=name)
  reloaded_ptx = load_hf(tmp_path)
  assert reloaded_ptx.cfg == model.cfg
  jax.tree.map(np.testing.assert_array_equal, reloaded_ptx.params, model.params)  # load -> save -> load: bit-exact
  with pytest.raises(hf_config.HFConfigError, match="not 'gemma3'"):
    save_hf(model, tmp_path / "multimodal", model_type="gemma3")


def test_sharded_load_matches_single_device(checkpoint):
  name, path, tokens, expected = checkpoint
  mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
  model = load_hf(path, mesh=mesh)
  want = param_shardings(model.cfg, mesh)
  for (where, array), sharding in zip(jax.tree_util.tree_leaves_with_path(model.params), jax.tree.leaves(want)):
    assert array.sharding == sharding, where
  gate = model.params["layers"]["expert_gate" if model.cfg.moe.enabled else "gate"]
  assert gate.sharding.shard_shape(gate.shape)[-1] == gate.shape[-1] // 4  # the MLP's hidden units over tensor
  # Sharded vs single-device forward of the same weights: float32 reduction order across shards, logits of O(1).
  np.testing.assert_allclose(_ptx_logits(model, tokens), _ptx_logits(load_hf(path), tokens), atol=1e-5, rtol=0)
  np.testing.assert_allclose(_ptx_logits(model, tokens), expected, atol=1e-4, rtol=0, err_msg=name)


def test_bfloat16_load(checkpoint):
  _, path, tokens, expected = checkpoint
  model = load_hf(path, dtype="bfloat16")
  assert model.params["layers"]["q"].dtype == jnp.bfloat16 and model.cfg.compute_dtype == "bfloat16"
  assert np.abs(_ptx_logits(model, tokens) - expected).mean() < 0.1 * np.abs(expected).mean()


def test_gemma3_multimodal_checkpoint(tmp_path):
  text = {**_COMMON, **_GEMMA, "sliding_window_pattern": 2, "rope_local_base_freq": 100.0}
  vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                patch_size=14)
  config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                     image_token_index=_COMMON["vocab_size"] - 1)
  model = _randomize(transformers.Gemma3ForConditionalGeneration(config), 0)
  model.save_pretrained(tmp_path)
  tokens = np.random.default_rng(2).integers(0, _COMMON["vocab_size"] - 1, (2, T))
  expected = _hf_logits(model, tokens)
  np.testing.assert_allclose(_ptx_logits(load_hf(tmp_path), tokens), expected, atol=1e-4, rtol=0)

  def older_names(tensors):  # transformers 4 wrote language_model.model.* and top-level towers
    for name in list(tensors):
      new = name.replace("model.language_model.", "language_model.model.")
      new = new.replace("model.vision_tower.", "vision_tower.")
      tensors[new] = tensors.pop(name)

  _edit_tensors(tmp_path, older_names)
  np.testing.assert_allclose(_ptx_logits(load_hf(tmp_path), tokens), expected, atol=1e-4, rtol=0)


def _tiny_llama(tmp_path):
  config = transformers.LlamaConfig(**_COMMON)
  _randomize(transformers.LlamaForCausalLM(config), 0).save_pretrained(tmp_path)
  return tmp_path


def _edit_tensors(path, edit):
  from safetensors.numpy import load_file, save_file

  tensors = load_file(path / "model.safetensors")
  edit(tensors)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_unexpected_tensor_is_named(tmp_path):
  path = _tiny_llama(tmp_path)
  _edit_tensors(path, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(40, np.float32)}))
  with pytest.raises(CheckpointError, match=r"model\.safetensors.*unexpected tensor 'model\.layers\.0\.self_attn"):
    load_hf(path)


def test_missing_tensor_is_named(tmp_path):
  path = _tiny_llama(tmp_path)
  _edit_tensors(path, lambda t: t.pop("model.layers.3.mlp.up_proj.weight"))
  with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.3\.mlp\.up_proj\.weight'"):
    load_hf(path)


def test_wrong_shape_is_named(tmp_path):
  path = _tiny_llama(tmp_path)
  _edit_tensors(path, lambda t: t.update({"model.norm.weight": np.ones(41, np.float32)}))
  with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \[41\], "
                                            r"expected \[40\]"):
    load_hf(path)


def test_a_cut_shard_is_named_with_its_sizes(tmp_path):
  path = _tiny_llama(tmp_path)
  shard = path / "model.safetensors"
  data = shard.read_bytes()
  header_len = int.from_bytes(data[:8], "little")
  shard.write_bytes(data[:300])  # inside the header
  with pytest.raises(CheckpointError, match=f"{shard}: 300 bytes, too short for the {header_len}-byte safetensors "
                                            "header it announces: the file is cut short"):
    load_hf(path)
  shard.write_bytes(data[:-1000])  # the header whole, the last tensor's data cut
  with pytest.raises(CheckpointError, match=f"{shard}: {len(data) - 1000} bytes, but its safetensors header describes "
                                            f"{len(data)}: the tensor data is cut short"):
    load_hf(path)
  shard.write_bytes(data[:8] + b"{" * header_len + data[8 + header_len:])
  with pytest.raises(CheckpointError, match=f"{shard}: not a safetensors file \\(its header does not parse"):
    load_hf(path)
  header = json.dumps({"x": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}).encode()
  shard.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))  # sizes agree; safetensors refuses it
  with pytest.raises(CheckpointError, match=f"{shard}: unreadable safetensors file \\(.*unknown variant `F99`"):
    load_hf(path)


def test_unknown_model_type_and_options_are_refused(tmp_path):
  path = _tiny_llama(tmp_path)
  config = json.loads((path / "config.json").read_text())
  for change, message in (({"model_type": "mamba"}, "unsupported model_type 'mamba'"),
                          ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}},
                           "rope_type 'longrope'"),
                          ({"attention_bias": True}, "attention_bias=true")):
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(hf_config.HFConfigError, match=message):
      load_hf(path)


def test_save_refuses_what_the_family_cannot_express(tiny_config):
  llama = hf_config.FAMILIES["llama"]
  with pytest.raises(hf_config.HFConfigError, match="attn_logit_softcap"):
    hf_config.hf_config(dataclasses.replace(tiny_config, attn_logit_softcap=5.0), llama)
  with pytest.raises(hf_config.HFConfigError, match="qkv_bias"):
    hf_config.hf_config(dataclasses.replace(tiny_config, qkv_bias=True), llama)
  with pytest.raises(hf_config.HFConfigError, match="sliding_window"):
    hf_config.hf_config(dataclasses.replace(tiny_config, sliding_window=8), llama)


def test_a_device_block_reads_only_the_experts_it_holds(tmp_path, monkeypatch):
  """Experts split over `tensor` by the rules: each block of an expert weight reads its own experts' HF tensors."""
  from ptx import sharding
  from ptx.models import hf_layout, hf_load  # noqa: F401  (hf_load.hf_layout is patched)

  config = transformers.CONFIG_MAPPING["qwen3_moe"](**{**_COMMON, "num_hidden_layers": 2, "num_experts": 8,
                                                       "num_experts_per_tok": 2, "moe_intermediate_size": 16})
  model = _randomize(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"), 0)
  model.save_pretrained(tmp_path)
  tokens = np.random.default_rng(1).integers(0, _COMMON["vocab_size"], (2, T))
  rules = sharding.rules_of(MeshConfig(param_rules=("experts=tensor", "mlp=")))
  mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
  reads = []
  real_read = hf_layout.read_block
  monkeypatch.setattr(hf_load.hf_layout, "read_block", lambda read, leaf, *a: reads.append(leaf) or
                      real_read(read, leaf, *a))
  loaded = load_hf(tmp_path, mesh=mesh, rules=rules)
  gate = loaded.params["layers"]["expert_gate"]
  assert gate.sharding.shard_shape(gate.shape)[1] == 2  # 8 experts over tensor 4
  # 4 distinct blocks (each replicated over data), each reading its own 2 experts of each of the 2 layers: 16 reads
  # of expert tensors, each expert's once; a block reading every expert would make 64.
  assert reads.count("expert_gate") == 2 * 8
  np.testing.assert_allclose(_ptx_logits(loaded, tokens), _hf_logits(model, tokens), atol=1e-4, rtol=0)
