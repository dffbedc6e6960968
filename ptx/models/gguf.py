"""GGUF (llama.cpp) -> HF checkpoint directory, tokenizer included.

`convert_gguf` reads a GGUF file with the `gguf` package, dequantises each
tensor in turn, renames it to its HF name, undoes llama.cpp's interleaving of
the q/k rows (so that HF's `rotate_half` RoPE applies) and writes
`config.json`, safetensors, `tokenizer.json` (the byte-level BPE rebuilt from
the GGUF vocabulary and merges), `tokenizer_config.json` (special tokens and
chat template) and `generation_config.json`; the special-token ids and the
context length are the GGUF's `tokenizer.ggml.*_token_id` and
`llama.context_length`. The result loads in `load_hf`,
`ptx.data.load_tokenizer` and `transformers` alike.

Supported: the `llama` architecture (Llama, SmolLM2, Mistral-style models)
with a `gpt2` (byte-level BPE) tokenizer. Anything else raises naming the
unsupported value.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Iterator

import jax.numpy as jnp
import numpy as np

from ptx import paths
from ptx.model_config import ModelConfig
from ptx.models.hf_config import hf_config
from ptx.models.hf_generation import GenerationInfo
from ptx.models.hf_save import DEFAULT_SHARD_BYTES, write_configs, write_tensors
from ptx.models.llama import HF_LLAMA

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# GGUF token types that HF keeps as added tokens: special ones, and plain ones.
_CONTROL, _USER_DEFINED = 3, 4


class GGUFError(ValueError):
  """A GGUF file this converter does not handle (names the field or tensor)."""


def convert_gguf(src: str | pathlib.Path, dst: str | pathlib.Path, *, dtype: str = "bfloat16",
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> pathlib.Path:
  """Converts a llama-architecture GGUF file into an HF model directory.

  Args:
    src: the `.gguf` file.
    dst: the output directory (created if needed).
    dtype: dtype of the written weights. float32 keeps the dequantised
      values exactly; bfloat16 (the default) halves the files and rounds
      them, which on SmolLM2-135M (Q4_1) moves float32-computed logits by up
      to 0.28 (of 38), the greedy tokens unchanged: far less than the 4-bit
      quantisation itself moved the original weights.
    max_shard_bytes: split the safetensors into shards of at most this size.

  Returns:
    The output directory.

  Raises:
    GGUFError: for an unsupported architecture, tokenizer or tensor.
  """
  import gguf  # the gguf extra; only this converter needs it

  src, dst = paths.path(src), paths.path(dst)  # dst local or gs://
  if not paths.is_local(src):
    raise GGUFError(f"{src}: a GGUF file is memory-mapped, so it must be local; copy it to this machine first")
  reader = gguf.GGUFReader(src)
  meta = {name: field.contents() for name, field in reader.fields.items()}
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise GGUFError(f"{src}: general.architecture {arch!r} is not supported (llama)")
  # Everything is checked before the first byte is written.
  names = _hf_names(reader, src)
  cfg = _model_config(meta, tied="lm_head.weight" not in names, dtype=dtype)
  generation = _generation(meta)
  tokenizer, tokenizer_config = _tokenizer(meta, src, generation.max_position_embeddings)
  dst.mkdir(parents=True, exist_ok=True)
  write_tensors(_hf_tensors(reader, names, cfg, np.dtype(jnp.dtype(dtype))), dst, max_shard_bytes)
  write_configs(hf_config(cfg, HF_LLAMA), generation, dst)
  (dst / "tokenizer.json").write_text(tokenizer.to_str(pretty=True))  # as `Tokenizer.save` writes it
  (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
  return dst


def _generation(meta: dict[str, Any]) -> GenerationInfo:
  """The special-token ids and context length a GGUF file declares."""

  def token(key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if value is None else int(value)

  eos, length = token("eos"), meta.get("llama.context_length")
  return GenerationInfo(bos_token_id=token("bos"), eos_token_ids=() if eos is None else (eos,),
                        pad_token_id=token("padding"), max_position_embeddings=None if length is None else int(length))


def _model_config(meta: dict[str, Any], *, tied: bool, dtype: str) -> ModelConfig:
  """The ModelConfig of a llama GGUF from its `llama.*` metadata."""
  if "llama.rope.scaling.type" in meta or "llama.rope.freq_scale" in meta:
    raise GGUFError("llama.rope.scaling.* / freq_scale: GGUF RoPE scaling is not supported")
  n_heads, d_model = int(meta["llama.attention.head_count"]), int(meta["llama.embedding_length"])
  return ModelConfig(
      vocab_size=int(meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])), d_model=d_model,
      n_layers=int(meta["llama.block_count"]), n_heads=n_heads,
      n_kv_heads=int(meta.get("llama.attention.head_count_kv", n_heads)),
      head_dim=int(meta.get("llama.rope.dimension_count", d_model // n_heads)),
      mlp_dim=int(meta["llama.feed_forward_length"]),
      # GGUF stores these as float32; print-round them back to the published values.
      norm_eps=_short(meta["llama.attention.layer_norm_rms_epsilon"]),
      rope_theta=_short(meta.get("llama.rope.freq_base", 10_000.0)), tie_embeddings=tied,
      param_dtype=dtype, compute_dtype=dtype)


def _short(x: float) -> float:
  return float(f"{float(x):.7g}")


def _hf_names(reader: Any, src: pathlib.Path) -> list[str]:
  """The HF name of each GGUF tensor, in file order; raises on an unknown one."""
  names = []
  for t in reader.tensors:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
    if t.name in _TOP:
      names.append(_TOP[t.name])
    elif m and m.group(2) in _LAYER:
      names.append(f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight")
    else:
      raise GGUFError(f"{src}: unexpected tensor {t.name!r}")
  return names


def _hf_tensors(reader: Any, names: list[str], cfg: ModelConfig, dtype: np.dtype) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (HF name, array [out, in]) per GGUF tensor, dequantised one at a time."""
  from gguf.quants import dequantize

  for t, name in zip(reader.tensors, names):
    w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
    if name.endswith("q_proj.weight"):
      w = _unpermute(w, cfg.n_heads)
    elif name.endswith("k_proj.weight"):
      w = _unpermute(w, cfg.n_kv_heads)
    yield name, np.ascontiguousarray(w.astype(dtype))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's per-head (half, pair) -> (pair, half) row interleave of q/k."""
  out, inp = w.shape
  return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _tokenizer(meta: dict[str, Any], src: pathlib.Path, max_length: int | None) -> tuple[Any, dict[str, Any]]:
  """The `tokenizers.Tokenizer` and tokenizer_config.json rebuilt from the GGUF metadata."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

  kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
  if kind != "gpt2":
    raise GGUFError(f"{src}: tokenizer.ggml.model {kind!r} is not supported (gpt2 byte-level BPE)")
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  # llama.cpp's pre-tokenizer names -> the HF pre-tokenizer of the same model.
  known = {"smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
           "gpt2": byte_level, "default": byte_level}
  if pre not in known:
    raise GGUFError(f"{src}: tokenizer.ggml.pre {pre!r} is not supported ({sorted(known)})")
  tokens = meta["tokenizer.ggml.tokens"]
  merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
  tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
  tok.pre_tokenizer = known[pre]
  tok.decoder = decoders.ByteLevel()
  types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                          for i, t in enumerate(types) if t == _CONTROL])
  tok.add_tokens([AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED])

  def token(key: str) -> str | None:
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if i is None else tokens[int(i)]

  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos"), "eos_token": token("eos"),
            "pad_token": token("padding"), "unk_token": token("unknown"),
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False, "chat_template": meta.get("tokenizer.chat_template")}
  return tok, {k: v for k, v in config.items() if v is not None}
