"""MXFP4 checkpoint tensors (gpt-oss's MoE experts): dequantised on read, against references of the format.

The references: the format's definition written here in numpy from the OCP Microscaling Formats (MX) v1.0 spec
(E2M1 elements decoded from their bits, E8M0 scales), and transformers' own reading of gpt-oss's packed experts
(`integrations.mxfp4.convert_moe_packed_tensors`), which fixes what the spec leaves to the checkpoint: two codes a
byte with the even element in the low nibble, and the hub layout [E, C, R] the packed [E, R, C / 32, 16] turns into.
"""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ptx.config import MeshConfig
from ptx.models import load_hf, mxfp4
from ptx.models.hf_config import HFConfigError
from ptx.models.hf_load import CheckpointError, read_tensor
from ptx.sharding import make_mesh

# The extreme exponents take some values past float32 to inf, as the format defines; numpy warns of each.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in ldexp:RuntimeWarning")

E, D, F = 4, 96, 32  # experts; hidden and expert MLP widths, multiples of the block of 32 (D splits mid-block on 2)
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"  # [E, D, 2F] in the bf16 hub layout
DOWN = "model.layers.0.mlp.experts.down_proj"  # [E, F, D]
ROUTER = "model.layers.0.mlp.router.weight"  # stored unquantised
# gpt-oss's quantization_config, less its attention and embedding entries.
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.router", "lm_head"]}


def e2m1(codes):
  """OCP MX v1.0 E2M1: sign bit, two exponent bits of bias 1 (0: subnormal, 2^0 * m / 2), one mantissa bit."""
  sign, exponent, mantissa = (codes >> 3) & 1, (codes >> 1) & 3, codes & 1
  magnitude = np.where(exponent == 0, mantissa / 2, 2.0 ** (exponent.astype(np.int64) - 1) * (1 + mantissa / 2))
  return np.where(sign == 1, -magnitude, magnitude)


def reference(blocks, scales):
  """The format's values, float32 [..., R, G * 32], of blocks [..., R, G, 16] and scales [..., R, G].

  Element 2j (2j + 1) of a block is byte j's low (high) nibble, times 2^(s - 127) (E8M0; 255 is NaN); each product
  is formed exactly in float64, then rounded to float32 once.
  """
  elements = np.stack([e2m1(blocks & 0x0F), e2m1(blocks >> 4)], axis=-1).reshape(*scales.shape, 32)
  scale = np.where(scales == 255, np.nan, 2.0 ** (scales.astype(np.int64) - 127))
  with np.errstate(over="ignore"):  # 2^127 * 2 and above is past float32: inf, as in the reading under test
    return (elements * scale[..., None]).reshape(*scales.shape[:-1], -1).astype(np.float32)


def packed(rng, rows, cols, exponents=range(256)):
  """Random MXFP4 blocks [E, rows, cols / 32, 16] and scales holding every byte value and every given exponent."""
  blocks = rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
  blocks.reshape(-1)[:256] = np.arange(256)  # every pair of codes, each code in both nibbles
  scales = rng.choice(np.array(exponents, np.uint8), (E, rows, cols // 32))
  scales.reshape(-1)[:len(exponents)] = exponents
  return blocks, scales


def bits(x):
  """float32 bit patterns: `assert_array_equal` on them tells -0.0 from 0.0 and compares NaN's too."""
  return np.asarray(x, np.float32).view(np.uint32)


def test_every_code_and_exponent_dequantises_as_the_spec_defines():
  blocks, scales = packed(np.random.default_rng(0), 2 * F, D)
  got = mxfp4.dequantise(blocks, scales)
  assert got.dtype == np.float32 and got.shape == (E, 2 * F, D)
  np.testing.assert_array_equal(bits(got), bits(reference(blocks, scales)))
  assert np.isnan(got).any() and np.isinf(got).any() and np.abs(got[np.isfinite(got) & (got != 0)]).min() == 2.0 ** -128
  # The even element is the low nibble: byte 0x71 is codes 1 (0.5) then 7 (6.0).
  np.testing.assert_array_equal(mxfp4.dequantise(np.full((1, 16), 0x71, np.uint8), np.array([127], np.uint8))[:2],
                                [0.5, 6.0])


def test_bfloat16_holds_every_finite_value():
  """The loader casts the float32 values to the parameter dtype: for bfloat16 that rounds nothing."""
  blocks, scales = packed(np.random.default_rng(1), 2 * F, D, exponents=range(255))
  values = mxfp4.dequantise(blocks, scales)
  values = values[np.isfinite(values)]
  np.testing.assert_array_equal(bits(values.astype(jax.numpy.bfloat16).astype(np.float32)), bits(values))


def test_dequantisation_matches_transformers():
  """transformers' reading of gpt-oss's experts: the same values in the same [E, C, R] layout, bit for bit.

  Exponents stop at 254: at 255, which E8M0 defines as NaN, transformers' `ldexp` gives +-inf (0 for a zero code).
  """
  torch = pytest.importorskip("torch", reason="transformers' MXFP4 reference needs torch (`make test`)")
  integration = pytest.importorskip("transformers.integrations.mxfp4")
  for rows, cols in [(2 * F, D), (D, F)]:  # gate_up_proj, down_proj
    blocks, scales = packed(np.random.default_rng(rows), rows, cols, exponents=range(255))
    theirs = integration.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                    dtype=torch.float32).numpy()
    ours = mxfp4.read_slice(blocks.__getitem__, scales.__getitem__, (slice(0, E), slice(0, cols), slice(0, rows)))
    assert ours.shape == theirs.shape == (E, cols, rows)
    np.testing.assert_array_equal(bits(ours), bits(theirs))


def test_a_slice_reads_only_the_blocks_covering_it():
  blocks, scales = packed(np.random.default_rng(2), 2 * F, D, exponents=range(100, 140))
  whole = reference(blocks, scales).swapaxes(-1, -2)  # the hub layout [E, D, 2F]
  read = []
  for index in [(slice(1, 3), slice(40, 70), slice(3, 9)), (slice(3, 4), slice(95, 96), slice(0, 64))]:
    got = mxfp4.read_slice(lambda i: read.append(i) or blocks[i], scales.__getitem__, index)
    np.testing.assert_array_equal(bits(got), bits(whole[index]))
  # Experts 1..2, rows 3..8, and columns 40..69: the blocks of 32 columns 1 and 2.
  assert read[0] == (slice(1, 3), slice(3, 9), slice(1, 3), slice(0, 16))


def _write(path, tensors, quantization=MXFP4):
  """A directory with `tensors` in model.safetensors and a config.json holding only `quantization`."""
  from safetensors.numpy import save_file

  path.mkdir(exist_ok=True)
  save_file(tensors, path / "model.safetensors")
  (path / "config.json").write_text(json.dumps({} if quantization is None else {"quantization_config": quantization}))
  return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(directory, {hub name: float32 dequantised reference}) of gpt-oss's packed experts and an unquantised router."""
  rng = np.random.default_rng(3)
  tensors, want = {ROUTER: rng.normal(size=(E, D)).astype(np.float32)}, {}
  for name, rows, cols in [(GATE_UP, 2 * F, D), (DOWN, D, F)]:
    blocks, scales = packed(rng, rows, cols, exponents=range(255))
    tensors |= {name + "_blocks": blocks, name + "_scales": scales}
    want[name] = reference(blocks, scales).swapaxes(-1, -2)
  want[ROUTER] = tensors[ROUTER]
  return _write(tmp_path_factory.mktemp("mxfp4"), tensors), want


def test_the_loader_reads_packed_tensors_in_their_hub_layout(checkpoint):
  path, want = checkpoint
  for name in (GATE_UP, DOWN, ROUTER):
    got = read_tensor(path, name)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(bits(got), bits(want[name]), err_msg=name)


@pytest.mark.slow
def test_transformers_loads_the_same_experts(checkpoint, tmp_path):
  """transformers' own loading of a gpt-oss MXFP4 directory (dequantised on CPU) gives the same tensors."""
  torch = pytest.importorskip("torch", reason="HF parity tests need torch (`make test`)")
  transformers = pytest.importorskip("transformers", reason="HF parity tests need transformers (`make test`)")
  from safetensors.numpy import load_file, save_file

  config = transformers.GptOssConfig(vocab_size=64, hidden_size=D, intermediate_size=F, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=E,
                                     num_experts_per_tok=2, layer_types=["full_attention"])
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
  tensors = load_file(tmp_path / "model.safetensors")
  assert tensors.pop(GATE_UP).shape == (E, D, 2 * F) and tensors.pop(DOWN).shape == (E, F, D)
  save_file(tensors | load_file(checkpoint[0] / "model.safetensors"), tmp_path / "model.safetensors",
            metadata={"format": "pt"})
  hf = json.loads((tmp_path / "config.json").read_text()) | {"quantization_config": MXFP4}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32)
  theirs = model.state_dict()
  for name in (GATE_UP, DOWN, ROUTER):
    np.testing.assert_array_equal(bits(theirs[name].numpy()), bits(read_tensor(checkpoint[0], name)), err_msg=name)


@pytest.mark.parametrize("spec", [P("expert", None, None), P("expert", "tensor", None)])
def test_a_sharded_read_reads_each_devices_experts(checkpoint, spec, monkeypatch):
  """Experts split over `expert`, and with `tensor` the columns too (gate_up's D in halves of 48: mid-block)."""
  path, want = checkpoint
  read, read_slice = [], mxfp4.read_slice
  monkeypatch.setattr(mxfp4, "read_slice", lambda *args: read.append(args[-1]) or read_slice(*args))
  sharding = NamedSharding(make_mesh(MeshConfig(data=1, fsdp=1, expert=4, tensor=2)), spec)
  for name in (GATE_UP, DOWN):
    read.clear()
    got = read_tensor(path, name, sharding)
    assert len(read) == 8 and all(index[0].stop - index[0].start == 1 for index in read)  # one expert a device
    assert got.sharding == sharding
    np.testing.assert_array_equal(bits(got), bits(read_tensor(path, name)), err_msg=name)
    np.testing.assert_array_equal(bits(got), bits(want[name]), err_msg=name)


def test_a_packed_tensor_needs_an_mxfp4_quantization_config(checkpoint, tmp_path):
  path, _ = checkpoint
  from safetensors.numpy import load_file

  tensors = load_file(path / "model.safetensors")
  for quantization, said in [(None, "no quantization_config"),
                             ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quant_method 'fp8'")]:
    other = _write(tmp_path / str(said).replace(" ", "_"), tensors, quantization)
    with pytest.raises(CheckpointError, match=rf"tensor '{GATE_UP}_blocks' holds '{GATE_UP}' in MXFP4 blocks, but "
                                              rf"config.json has {said}: quantization_config quant_method 'mxfp4'"):
      read_tensor(other, GATE_UP)
  with pytest.raises(HFConfigError, match=r"config.json: quantization_config quant_method='gptq' is not supported"):
    read_tensor(_write(tmp_path / "gptq", tensors, {"quant_method": "gptq"}), GATE_UP)


@pytest.mark.parametrize("edit, error", [
    (lambda t: t.pop(DOWN + "_scales"), rf"MXFP4 tensor '{DOWN}_blocks' has no scales '{DOWN}_scales'"),
    (lambda t: t.update({DOWN + "_blocks": t[DOWN + "_blocks"].reshape(E, D, 16, 1)}),
     rf"tensor '{DOWN}_blocks' is U8 of shape \[4, 96, 16, 1\], expected U8 of shape \[experts, rows, columns / 32, "
     r"16\] \(config.json quantization_config quant_method 'mxfp4'\)"),
    (lambda t: t.update({DOWN + "_blocks": t[DOWN + "_blocks"].astype(np.int8)}), rf"tensor '{DOWN}_blocks' is I8"),
    (lambda t: t.update({DOWN + "_scales": t[DOWN + "_scales"][:, :-1]}),
     rf"tensor '{DOWN}_scales' is U8 of shape \[4, 95, 1\], expected U8 of shape \[4, 96, 1\]: a scale per block"),
])
def test_a_malformed_packed_tensor_is_named_with_its_file(checkpoint, tmp_path, edit, error):
  from safetensors.numpy import load_file

  tensors = load_file(checkpoint[0] / "model.safetensors")
  edit(tensors)
  with pytest.raises(CheckpointError, match="model.safetensors: " + error):
    read_tensor(_write(tmp_path, tensors), DOWN)


def test_load_hf_checks_packed_tensors_against_the_model(ptx_checkpoint, tmp_path):
  """Through the whole loader: a packed tensor takes the place of the tensor it holds, its hub shape checked."""
  from safetensors.numpy import load_file, save_file

  tensors = load_file(ptx_checkpoint / "model.safetensors")
  name = "model.layers.0.mlp.down_proj.weight"
  assert tensors.pop(name).shape == (48, 80)  # [D, F]: a 2-D weight, which MXFP4's [E, C, R] cannot hold
  tensors |= {name + "_blocks": np.zeros((1, 80, 1, 16), np.uint8), name + "_scales": np.zeros((1, 80, 1), np.uint8)}
  config = json.loads((ptx_checkpoint / "config.json").read_text()) | {"quantization_config": {"quant_method": "mxfp4"}}
  (tmp_path / "config.json").write_text(json.dumps(config))
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(CheckpointError, match=rf"tensor '{name}_blocks' has shape \[1, 80, 1, 16\] \(MXFP4 blocks of "
                                            r"\[1, 32, 80\]\), expected \[48, 80\] for ptx layers/down"):
    load_hf(tmp_path)
