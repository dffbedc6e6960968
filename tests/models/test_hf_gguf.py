"""The GGUF converter on a tiny GGUF written the way llama.cpp writes one.

The file is built from a random transformers Llama with llama.cpp's own q/k
row permutation and a small byte-level BPE vocabulary, so conversion back to
HF must reproduce transformers' logits exactly (float32, no quantisation).
"""

import json
import numpy as np
import pytest

from ptx.data import load_tokenizer
from ptx.models import load_hf
from ptx.models.gguf import GGUFError, convert_gguf
from ptx.models.hf_generation import GenerationInfo, read_generation

gguf = pytest.importorskip("gguf", reason="the GGUF converter needs the gguf package (`make test`)")
torch = pytest.importorskip("torch", reason="GGUF parity needs torch (installed by `make test`)")
transformers = pytest.importorskip("transformers", reason="GGUF parity needs transformers (`make test`)")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
_HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w, n_head):
  """convert_hf_to_gguf.py's LlamaModel.permute: rotate_half pairs -> interleaved pairs."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab():
  from tokenizers import pre_tokenizers

  tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]
  return tokens, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))


def _write_gguf(path, model, arch="llama"):
  cfg = model.config
  tokens, types = _vocab()
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(cfg.num_hidden_layers)
  w.add_context_length(64)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_rope_freq_base(10_000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(len(tokens))
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("gpt2")
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(MERGES)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
  for name, tensor in model.state_dict().items():
    x = tensor.numpy().astype(np.float32)
    if name.endswith("q_proj.weight"):
      x = llama_cpp_permute(x, cfg.num_attention_heads)
    elif name.endswith("k_proj.weight"):
      x = llama_cpp_permute(x, cfg.num_key_value_heads)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
      w.add_tensor(top[name], x)
    else:
      _, _, i, rest = name.split(".", 3)
      w.add_tensor(f"blk.{i}.{_HF_TO_GGUF[rest.removesuffix('.weight')]}.weight", x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.fixture
def llama():
  config = transformers.LlamaConfig(vocab_size=len(_vocab()[0]), hidden_size=40, intermediate_size=96,
                                    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=14,
                                    rope_theta=10_000.0, rms_norm_eps=1e-5)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config)
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.2)
  return model.eval()


def test_unpermute_inverts_llama_cpp():
  from ptx.models.gguf import _unpermute

  w = np.arange(8 * 14 * 5, dtype=np.float32).reshape(8 * 14, 5)
  np.testing.assert_array_equal(_unpermute(llama_cpp_permute(w, 8), 8), w)


def test_converted_tiny_gguf_matches_transformers(llama, tmp_path):
  _write_gguf(tmp_path / "tiny.gguf", llama)
  out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype="float32")
  tokens = np.random.default_rng(0).integers(0, llama.config.vocab_size, (2, 20))
  with torch.no_grad():
    expected = llama(torch.tensor(tokens)).logits.numpy()
  model = load_hf(out)
  assert not model.cfg.tie_embeddings and model.cfg.norm_eps == 1e-5
  # HF parity: torch and XLA each sum in their own float32 order; 1e-4 on O(1) logits.
  np.testing.assert_allclose(np.asarray(model(tokens.astype(np.int32))), expected, atol=1e-4, rtol=0)

  tokenizer = load_tokenizer(out)
  text = "<|im_start|>the tin ant<|im_end|>"
  ids = tokenizer.encode(text)
  assert ids[0] == 1 and ids[-1] == 2 and tokenizer.decode(ids) == "the tin ant"
  assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == ids
  assert tokenizer.chat_template is not None and tokenizer.eos_id == 2

  # The GGUF's special-token ids and context length, where transformers reads them.
  assert read_generation(out) == GenerationInfo(bos_token_id=1, eos_token_ids=(2,), max_position_embeddings=64)
  assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 2
  assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 64


def test_other_architectures_are_refused(llama, tmp_path):
  _write_gguf(tmp_path / "tiny.gguf", llama, arch="qwen2")
  with pytest.raises(GGUFError, match="general.architecture 'qwen2' is not supported"):
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")


def test_ptx_convert_gguf_command(llama, tmp_path, capsys):
  from ptx import cli

  _write_gguf(tmp_path / "tiny.gguf", llama)
  assert cli.main(["convert", "gguf", str(tmp_path / "tiny.gguf"), str(tmp_path / "hf"), "--dtype=float32"]) == 0
  assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "hf" / "tokenizer.json").exists()
  assert capsys.readouterr().out.endswith(": float32 weights\n")
  assert cli.main(["convert", "gguf", str(tmp_path / "tiny.gguf"), str(tmp_path / "bf16")]) == 0
  assert "bfloat16 weights (rounded" in capsys.readouterr().out  # the default says what it costs
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  with pytest.raises(SystemExit):
    cli.main(["convert", "gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "hf2")])
  assert "missing.gguf" in capsys.readouterr().err


def test_ptx_eval_reports_pass_at_k_and_compares(llama, tmp_path, capsys):
  from ptx import cli

  _write_gguf(tmp_path / "tiny.gguf", llama)
  cli.main(["convert", "gguf", str(tmp_path / "tiny.gguf"), str(tmp_path / "hf"), "--dtype=float32"])
  for name, temperature in (("a", "1.0"), ("b", "0")):
    assert cli.main(["eval", "--model", str(tmp_path / "hf"), "--task", "arithmetic", "--n", "3", "--k", "2",
                     "--max-new-tokens", "4", "--temperature", temperature, "--out", str(tmp_path / name)]) == 0
  report = json.loads((tmp_path / "a" / "eval.json").read_text())
  assert report["tasks"] == 3 and report["k"] == 2 and set(report["pass@k"]) == {"1", "2"}
  assert sum(report["outcomes"].values()) == 6
  capsys.readouterr()
  cli.main(["eval", "--compare", str(tmp_path / "a" / "eval.json"), str(tmp_path / "b" / "eval.json")])
  assert "pass@1" in capsys.readouterr().out
