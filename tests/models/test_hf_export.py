"""Exports are complete: transformers generates from them and stops where ptx stops.

For each family ptx writes (Llama, Qwen2, Qwen3, Gemma 2, Gemma 3), a tiny
random model is saved as a "source" checkpoint declaring a context length,
then exported by `export_hf` with a tokenizer whose eos is a token the model
greedily emits a few steps in. transformers' plain `generate` on the export
must produce ptx's greedy tokens and stop on that eos; the special-token
ids, context length, sampling defaults and chat template survive, and every
file is readable by all.
"""

import dataclasses
import json
import os
import stat
import types

import jax
import numpy as np
import pytest

from model_variants import gemma_like
from ptx.config import Config
from ptx.model_config import ModelConfig
from ptx.data.chat import JinjaChatTemplate
from ptx.data.hf_tokenizer import HFTokenizer, load_tokenizer
from ptx.models import Decoder, init_params, save_hf
from ptx.models.hf_config import HFConfigError
from ptx.models.hf_generation import GenerationInfo, read_generation, with_tokenizer
from ptx.models.hf_save import infer_model_type
from ptx.sampling.generation import generate
from ptx.sampling.rules import SamplingConfig
from ptx.train.export import export_hf

torch = pytest.importorskip("torch", reason="export parity needs torch (installed by `make test`)")
transformers = pytest.importorskip("transformers", reason="export parity needs transformers (`make test`)")

VOCAB, NEW = 64, 12
PROMPT = [5, 17, 33, 9]
CONTEXT = 4096  # what the source declares; no family defaults to it, so a dropped value shows
TEMPLATE = "{% for m in messages %}t1{{ m['content'] }}t2{% endfor %}"
# init_std 0.5: logits far apart, so greedy picks agree between two float32 implementations.
_TINY = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                    init_std=0.5)
_GEMMA = dataclasses.replace(gemma_like(_TINY), sliding_window=3)
FAMILIES = {
    "llama": _TINY,
    "qwen2": dataclasses.replace(_TINY, qkv_bias=True, tie_embeddings=True),
    "qwen3": dataclasses.replace(_TINY, qk_norm=True),
    "gemma2": dataclasses.replace(_GEMMA, qk_norm=False, rope_local_theta=None),
    "gemma3_text": _GEMMA,
}


def _tokenizer(eos: int) -> HFTokenizer:
  """Word-level tokens t0..t63 with t{eos} as the end token and the test's chat template."""
  from tokenizers import Tokenizer, models

  tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
  return HFTokenizer(tok, eos_token=f"t{eos}", bos_token="t1", pad_token="t0",
                     chat_template=JinjaChatTemplate(TEMPLATE, "t1", f"t{eos}"))


def _greedy(params, cfg, stop_ids):
  out = generate(params, [PROMPT], cfg=cfg, max_new_tokens=NEW, sampling=SamplingConfig(greedy=True),
                 rng=jax.random.key(0), stop_ids=stop_ids)
  return np.asarray(out.tokens)[0, :int(out.lengths[0])].tolist()


def _end_token(tokens: list[int]) -> int:
  """A token whose first appearance is a few steps in (the first one if the model repeats one token)."""
  firsts = [t for k, t in enumerate(tokens) if k >= 2 and t not in tokens[:k]]
  return firsts[0] if firsts else tokens[0]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def exported(request, tmp_path_factory):
  """(family, params, cfg, tokenizer, source dir, export dir)."""
  cfg = FAMILIES[request.param]
  assert infer_model_type(cfg) == request.param
  params = init_params(cfg, jax.random.key(1))
  # Stopping on the source's extra end token (never emitted here) keeps the stop shape, so ptx compiles once.
  tokenizer = _tokenizer(_end_token(_greedy(params, cfg, stop_ids=[VOCAB - 1])))
  source = tmp_path_factory.mktemp(f"{request.param}_source")
  # The source declares a context length and one more end token (as Llama 3 Instruct does); ptx stops on
  # the tokenizer's eos, which comes first.
  save_hf(Decoder(cfg, params=params), source,
          generation=GenerationInfo(eos_token_ids=(VOCAB - 1,), max_position_embeddings=CONTEXT,
                                    defaults={"temperature": 0.7}))
  tokenizer.save_hf(source)
  out = tmp_path_factory.mktemp(request.param)
  written = export_hf(types.SimpleNamespace(params=params), Config(model=cfg), out, load_tokenizer(source),
                      base_model=str(source))
  return request.param, params, cfg, tokenizer, source, written["hf"]


def test_transformers_generate_stops_where_ptx_stops(exported):
  _, params, cfg, tokenizer, _, path = exported
  ptx_tokens = _greedy(params, cfg, stop_ids=[tokenizer.eos_id])
  if VOCAB - 1 in ptx_tokens:
    pytest.fail("the model emits the source's extra end token: pick another prompt")
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
  with torch.no_grad():
    hf = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)  # the export's defaults
  assert hf[0, len(PROMPT):].tolist() == ptx_tokens
  assert ptx_tokens[-1] == tokenizer.eos_id and len(ptx_tokens) < NEW  # it stopped on eos, not at the budget


def test_export_declares_what_the_source_and_tokenizer_do(exported):
  _, _, _, tokenizer, source, path = exported
  expected = with_tokenizer(read_generation(source), tokenizer)
  assert read_generation(path) == expected
  assert expected.eos_token_ids == (tokenizer.eos_id, VOCAB - 1) and expected.max_position_embeddings == CONTEXT
  assert (expected.bos_token_id, expected.pad_token_id) == (1, 0) and expected.defaults == {"temperature": 0.7}
  config = transformers.AutoConfig.from_pretrained(path)
  assert config.max_position_embeddings == CONTEXT
  generation = transformers.GenerationConfig.from_pretrained(path)
  assert generation.eos_token_id == [tokenizer.eos_id, VOCAB - 1] and generation.temperature == 0.7
  assert load_tokenizer(path).chat_template.source == TEMPLATE
  for file in path.iterdir():
    assert stat.S_IMODE(os.stat(file).st_mode) & 0o044 == 0o044, f"{file.name} is not readable by group and others"


def test_a_gguf_start_exports_what_its_conversion_declared(tmp_path):
  cfg = FAMILIES["llama"]
  params = init_params(cfg, jax.random.key(0))
  declared = GenerationInfo(bos_token_id=1, eos_token_ids=(2,), pad_token_id=2, max_position_embeddings=CONTEXT)
  # Where ptx.train.pretrained converts model.gguf.
  save_hf(Decoder(cfg, params=params), tmp_path / "pretrained", generation=declared)
  written = export_hf(types.SimpleNamespace(params=params), Config(model=cfg), tmp_path, None,
                      base_model=str(tmp_path / "model.gguf"))
  assert read_generation(written["hf"]) == declared


def test_a_fresh_model_declares_only_its_tokenizer(tmp_path):
  cfg = FAMILIES["llama"]
  save_hf(Decoder(cfg, params=init_params(cfg, jax.random.key(0))), tmp_path,
          generation=with_tokenizer(GenerationInfo(), _tokenizer(7)))
  config = json.loads((tmp_path / "config.json").read_text())
  assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 7, 0)
  assert "max_position_embeddings" not in config  # nothing declares it: transformers keeps its class default
  assert json.loads((tmp_path / "generation_config.json").read_text()) == {
      "bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 0}


@pytest.mark.parametrize("file,key,value", [("config.json", "eos_token_id", "2"),
                                            ("generation_config.json", "bos_token_id", [1, 2]),
                                            ("config.json", "max_position_embeddings", -1)])
def test_a_bad_declaration_is_named(tmp_path, file, key, value):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
  (tmp_path / file).write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()), key: value}))
  with pytest.raises(HFConfigError, match=f"{file}: {key} must be"):
    read_generation(tmp_path)
