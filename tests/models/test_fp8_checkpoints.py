"""FP8 block-scaled checkpoints (DeepSeek-V3, Qwen3 *-FP8): dequantised on read, against references of the format.

The references: the format's definition written here in numpy (each weight times its block's scale, the last
blocks cut short), transformers' own dequantisation of a weight (`_dequantize_fp8_weight`) and of a whole
checkpoint (`from_pretrained` of an FP8 directory on CPU), and transformers' logits of the dequantised weights.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptx.config import MeshConfig
from ptx.models import fp8_blocks, load_hf, save_hf
from ptx.models.hf_config import HFConfigError
from ptx.models.hf_load import CheckpointError, read_model_config
from ptx.models.params import param_shardings
from ptx.sharding import make_mesh

E4M3_MAX = 448.0  # the largest finite float8 e4m3fn value, which each block's largest weight is scaled to
T = 24
_COMMON = dict(vocab_size=264, hidden_size=40, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, head_dim=14, rope_theta=10_000.0, rms_norm_eps=1e-6)
# (model_type, extra config, weight_block_size). Qwen3 with blocks that divide every weight, which transformers'
# own loader needs; Qwen3-MoE with blocks that cut most weights' last rows or columns short and that the 4-way
# tensor-parallel slices (28 attention rows, 4 expert rows) start inside of.
CASES = {
    "qwen3": ("qwen3", {}, [4, 8]),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                    norm_topk_prob=True), [16, 32]),
}


def quantize(w, block):
  """(float8 values, float32 scale_inv) of a weight in the format, each block scaled to its largest value."""
  bm, bn = block
  grid = fp8_blocks.scale_shape(w.shape, block)
  amax = np.zeros(grid, np.float32)
  for i, j in np.ndindex(*grid):
    amax[i, j] = np.abs(w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]).max()
  scale_inv = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
  return (w / expand(scale_inv, block, w.shape)).astype(jnp.float8_e4m3fn), scale_inv


def expand(scale_inv, block, shape):
  """The scale of every weight entry: each block's scale repeated over it, the last blocks cut short."""
  return np.repeat(np.repeat(scale_inv, block[0], 0), block[1], 1)[:shape[0], :shape[1]]


def reference(values, scale_inv, block):
  """The format's definition: weight = float8 value * scale_inv of its block."""
  return values.astype(np.float32) * expand(scale_inv, block, values.shape)


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_a_slice_dequantises_as_the_format_defines(block):
  w = np.random.default_rng(0).normal(size=(300, 200)).astype(np.float32)
  w[:, -3:] *= 1000.0  # the last, cut-short column blocks get scales of their own
  values, scale_inv = quantize(w, block)
  assert scale_inv.shape == (-(-300 // block[0]), -(-200 // block[1]))
  want = reference(values, scale_inv, block)
  assert np.abs(want - w).max() > 0  # the weights went through float8
  read = []
  for index in [(slice(0, 300), slice(0, 200)), (slice(100, 290), slice(5, 131)), (slice(299, 300), slice(199, 200))]:
    got = fp8_blocks.read_slice(values.__getitem__, lambda i: read.append(i) or scale_inv[i], index, block)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want[index])
  # Only the scale blocks that cover a slice are read: rows 100..289 and columns 5..130.
  assert read[1] == (slice(100 // block[0], -(-290 // block[0])), slice(5 // block[1], -(-131 // block[1])))


def test_dequantisation_matches_transformers():
  """transformers' own dequantisation of a weight whose blocks do not divide it (its backward-pass helper)."""
  torch = pytest.importorskip("torch", reason="transformers' FP8 reference needs torch (`make test`)")
  finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
  w = np.random.default_rng(1).normal(size=(300, 200)).astype(np.float32)
  values, scale_inv = quantize(w, (128, 128))
  theirs = finegrained_fp8._dequantize_fp8_weight(torch.from_numpy(values.view(np.uint8)).view(torch.float8_e4m3fn),
                                                  torch.from_numpy(scale_inv), [128, 128], torch.float32)
  ours = fp8_blocks.read_slice(values.__getitem__, scale_inv.__getitem__, (slice(0, 300), slice(0, 200)), (128, 128))
  np.testing.assert_array_equal(ours, theirs.numpy())


def test_float8_values_are_read_from_the_file_bytes(tmp_path):
  """A slice of the second tensor of a file that torch's safetensors wrote, at its header's offset."""
  torch = pytest.importorskip("torch", reason="the float8 file is written by torch's safetensors (`make test`)")
  from safetensors.torch import save_file

  tensors = {"a": torch.randn(3, 7).to(torch.float8_e4m3fn), "b": torch.randn(9, 5).to(torch.float8_e4m3fn)}
  save_file(tensors, tmp_path / "x.safetensors")
  raw = (tmp_path / "x.safetensors").read_bytes()
  header_len = int.from_bytes(raw[:8], "little")
  start = 8 + header_len + json.loads(raw[8:8 + header_len])["b"]["data_offsets"][0]
  got = fp8_blocks.read_e4m3(tmp_path / "x.safetensors", start, (9, 5), (slice(2, 7), slice(1, 4)))
  assert got.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(got.astype(np.float32), tensors["b"][2:7, 1:4].float().numpy())


def _write_fp8(src, dst, block, torch):
  """Copies the float32 HF directory `src` as an FP8 checkpoint `dst`; returns its dequantised tensors."""
  from safetensors.torch import load_file, save_file

  shutil.copytree(src, dst)
  fp8, dequantised = {}, {}
  for name, t in load_file(src / "model.safetensors").items():
    if name.endswith("_proj.weight"):  # attention and MLP linears; not norms, embeddings, lm_head or the router
      values, scale_inv = quantize(t.numpy(), block)
      fp8[name] = torch.from_numpy(values.view(np.uint8)).view(torch.float8_e4m3fn)
      fp8[name + "_scale_inv"] = torch.from_numpy(scale_inv)
      dequantised[name] = torch.from_numpy(reference(values, scale_inv, block))
    else:
      fp8[name] = dequantised[name] = t
  save_file(fp8, dst / "model.safetensors", metadata={"format": "pt"})
  config = json.loads((src / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": block, "modules_to_not_convert": ["lm_head"]}
  (dst / "config.json").write_text(json.dumps(config))
  return dequantised


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
  """(name, FP8 directory, tokens, transformers' logits of the dequantised weights) of a tiny random model."""
  torch = pytest.importorskip("torch", reason="HF parity tests need torch (`make test`)")
  transformers = pytest.importorskip("transformers", reason="HF parity tests need transformers (`make test`)")
  from safetensors.torch import save_file

  model_type, extra, block = CASES[request.param]
  config = transformers.CONFIG_MAPPING[model_type](**{**_COMMON, **extra})
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  torch.manual_seed(0)
  with torch.no_grad():
    for p in model.parameters():  # every weight random, norms and router included
      p.copy_(torch.randn_like(p) * 0.2)
  root = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(root / "float32")
  dequantised = _write_fp8(root / "float32", root / "fp8", block, torch)
  save_file(dequantised, root / "float32" / "model.safetensors", metadata={"format": "pt"})

  def logits(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
      return hf.eval()(torch.tensor(tokens)).logits.numpy(), hf

  tokens = np.random.default_rng(1).integers(0, _COMMON["vocab_size"], (2, T))
  expected, reference_model = logits(root / "float32")
  if all(n % b == 0 for w in dequantised.values() if w.ndim == 2 for n, b in zip(w.shape, block)):
    pytest.importorskip("accelerate", reason="transformers reads FP8 checkpoints with accelerate")
    # transformers' own reading of the FP8 directory (dequantised on CPU) gives the same weights, bit for bit.
    theirs, fp8_model = logits(root / "fp8")
    for (name, a), (_, b) in zip(reference_model.state_dict().items(), fp8_model.state_dict().items()):
      np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)
    np.testing.assert_array_equal(theirs, expected)
  return request.param, root / "fp8", tokens, expected


def _ptx_logits(model, tokens):
  return np.asarray(model(jnp.asarray(tokens, jnp.int32)))


@pytest.mark.slow
def test_fp8_load_matches_transformers_on_the_dequantised_weights(checkpoint):
  name, path, tokens, expected = checkpoint
  # float32 logits of O(1) from the same float32 weights; reduction order differs (as in tests/models/test_hf.py).
  np.testing.assert_allclose(_ptx_logits(load_hf(path), tokens), expected, atol=1e-4, rtol=0, err_msg=name)


@pytest.mark.slow
def test_sharded_fp8_load_reads_slices_inside_scale_blocks(checkpoint):
  name, path, tokens, expected = checkpoint
  mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
  model = load_hf(path, mesh=mesh)
  for array, sharding in zip(jax.tree.leaves(model.params), jax.tree.leaves(param_shardings(model.cfg, mesh))):
    assert array.sharding == sharding
  np.testing.assert_allclose(_ptx_logits(model, tokens), expected, atol=1e-4, rtol=0, err_msg=name)


@pytest.mark.slow
def test_bfloat16_load_rounds_the_float32_product_once(checkpoint):
  _, path, _, _ = checkpoint
  exact, rounded = load_hf(path), load_hf(path, dtype="bfloat16")
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.astype(jnp.bfloat16), b), exact.params, rounded.params)


@pytest.mark.slow
def test_an_fp8_model_saves_unquantised(checkpoint, tmp_path):
  import torch  # the checkpoint fixture skips without torch and transformers
  import transformers
  from safetensors import safe_open

  name, path, tokens, expected = checkpoint
  model = load_hf(path)
  save_hf(model, tmp_path)
  assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
  with safe_open(tmp_path / "model.safetensors", framework="np") as f:
    assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"F32"}
    assert not [n for n in f.keys() if n.endswith("_scale_inv")]
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
  with torch.no_grad():
    hf_logits = reloaded(torch.tensor(tokens)).logits.float().numpy()
  np.testing.assert_allclose(hf_logits, expected, atol=1e-4, rtol=0, err_msg=name)


def _edit(path, edit):
  """Rewrites the FP8 checkpoint's tensors through `edit(dict of torch tensors)`."""
  from safetensors.torch import load_file, save_file

  tensors = load_file(path / "model.safetensors")
  edit(tensors)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def qwen3_fp8(checkpoint, tmp_path):
  """A copy of the Qwen3 FP8 checkpoint (tests using it pick that case with `ON_QWEN3`), to spoil."""
  return shutil.copytree(checkpoint[1], tmp_path / "fp8")


ON_QWEN3 = pytest.mark.parametrize("checkpoint", ["qwen3"], indirect=True)


SCALE = "model.layers.1.self_attn.k_proj.weight_scale_inv"


@pytest.mark.slow
@ON_QWEN3
def test_bfloat16_scales_read_as_their_float32_values(qwen3_fp8, tmp_path):
  import torch

  def scales_to(dtype):
    return lambda t: t.update({n: s.bfloat16().to(dtype) for n, s in t.items() if n.endswith("_scale_inv")})

  float32 = shutil.copytree(qwen3_fp8, tmp_path / "float32_scales")
  _edit(qwen3_fp8, scales_to(torch.bfloat16))
  _edit(float32, scales_to(torch.float32))  # the same values, stored as float32
  jax.tree.map(np.testing.assert_array_equal, load_hf(qwen3_fp8).params, load_hf(float32).params)


@pytest.mark.slow
@ON_QWEN3
def test_a_wrongly_shaped_scale_is_named_with_its_file(qwen3_fp8):
  import torch

  _edit(qwen3_fp8, lambda t: t.update({SCALE: torch.ones(5, 7)}))  # k_proj [28, 40] in [4, 8] blocks: [7, 5]
  with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '{SCALE}' is F32 of shape \[5, 7\], "
                                            r"expected F32 or BF16 of shape \[7, 5\].*weight_block_size"):
    load_hf(qwen3_fp8)


@pytest.mark.slow
@ON_QWEN3
def test_a_float8_weight_without_scales_is_refused(qwen3_fp8):
  _edit(qwen3_fp8, lambda t: t.pop(SCALE))
  with pytest.raises(CheckpointError, match="float8 tensor 'model.layers.1.self_attn.k_proj.weight' has no scales"):
    load_hf(qwen3_fp8)
  config = json.loads((qwen3_fp8 / "config.json").read_text())
  del config["quantization_config"]
  (qwen3_fp8 / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match="is float8 .* config.json has no quantization_config"):
    load_hf(qwen3_fp8)


@pytest.mark.parametrize("quantization, field", [
    ({"quant_method": "awq"}, "quant_method='awq'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt='e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size=None"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, r"weight_block_size=\[128, 0\]"),
])
def test_other_quantisations_are_refused_naming_the_field(tmp_path, quantization, field):
  config = {"model_type": "qwen3", **_COMMON, "hidden_act": "silu", "quantization_config": quantization}
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(HFConfigError, match=rf"config.json: quantization_config .*{field}"):
    read_model_config(tmp_path)
  config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert read_model_config(tmp_path).d_model == 40  # a supported quantization_config leaves the architecture alone
