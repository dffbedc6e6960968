"""Tokenizer adapters on vocabularies trained offline inside the tests."""

import io
import json

import pytest

from ptx.data.chat import encode_chat
from ptx.data.hf_tokenizer import HFTokenizer, load_tokenizer
from ptx.data.tokenizer import ByteTokenizer, Tokenizer, check_fits

TEXT = ["the quick brown fox jumps over the lazy dog", "2+2=4 and 3+5=8", "héllo wörld ünïcode"] * 20
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """An HF model directory with a tiny byte-level BPE trained here."""
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIALS, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TEXT, trainer)
  path = tmp_path_factory.mktemp("hf")
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "pad_token": "<pad>",
      "chat_template": CHAT_TEMPLATE}))
  return path


def test_byte_tokenizer_satisfies_the_protocol_and_round_trips():
  tok = ByteTokenizer()
  assert isinstance(tok, Tokenizer)
  assert tok.decode(tok.encode("héllo")) == "héllo"
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 259)


def test_load_tokenizer_reads_special_tokens_and_round_trips(hf_dir):
  tok = load_tokenizer(hf_dir)
  assert isinstance(tok, Tokenizer)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  for text in TEXT[:3]:
    assert tok.decode(tok.encode(text)) == text
  # encode adds no special tokens of its own; written ones map to their ids.
  ids = tok.encode("<|im_start|>user")
  assert ids[0] == 3 and 1 not in ids and 2 not in ids


def test_load_tokenizer_chat_template_masks_assistant_turns(hf_dir):
  tok = load_tokenizer(hf_dir)
  messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
  ids, mask = encode_chat(tok, messages)
  assert ids[0] == tok.bos_id  # written by the template as text, then mapped
  assert tok.decode([i for i, m in zip(ids, mask) if m]) == "4"  # <|im_end|> is special: skipped
  assert [i for i, m in zip(ids, mask) if m][-1] == 4  # the <|im_end|> id is a target


def test_chat_template_json_file_wins_and_pad_defaults_to_eos(hf_dir, tmp_path):
  (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": None}))
  (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  tok = load_tokenizer(tmp_path)
  assert tok.pad_id == tok.eos_id and tok.bos_id is None
  assert tok.chat_template.render([{"role": "user", "content": "x"}]) == "x"


def test_unknown_special_token_and_missing_files_are_errors(hf_dir, tmp_path):
  with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
    HFTokenizer.from_file(hf_dir / "tokenizer.json", eos_token="<eos>")
  with pytest.raises(FileNotFoundError):
    load_tokenizer(tmp_path)


@pytest.fixture(scope="module")
def sp_model():
  """A tiny SentencePiece model trained here."""
  spm = pytest.importorskip("sentencepiece")
  out = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_writer=out, vocab_size=60, hard_vocab_limit=False,
                                 character_coverage=1.0, pad_id=3, minloglevel=2)
  return out.getvalue()


def test_sentencepiece_adapter_round_trips(sp_model):
  from ptx.data.sentencepiece_tokenizer import SentencePieceTokenizer

  tok = SentencePieceTokenizer(model_proto=sp_model)
  assert isinstance(tok, Tokenizer)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3) and 40 < tok.vocab_size <= 60
  assert tok.decode(tok.encode("the lazy dog")) == "the lazy dog"
  assert tok.bos_id not in tok.encode("the lazy dog")


def test_load_tokenizer_falls_back_to_sentencepiece(sp_model, tmp_path):
  (tmp_path / "tokenizer.model").write_bytes(sp_model)
  tok = load_tokenizer(tmp_path)
  assert tok.decode(tok.encode("quick fox")) == "quick fox" and tok.chat_template is None


def test_byte_tokenizer_saved_as_hf_encodes_and_decodes_identically(tmp_path):
  transformers = pytest.importorskip("transformers")
  byte = ByteTokenizer()
  byte.save_hf(tmp_path)
  reloaded, auto = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
  assert (reloaded.pad_id, reloaded.bos_id, reloaded.eos_id) == (byte.pad_id, byte.bos_id, byte.eos_id)
  assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (0, 1, 2)
  for text in ["12+34=46", "héllo wörld\n\t ☃", " leading space", "\x00\x7f bytes"]:
    ids = byte.encode(text)
    assert reloaded.encode(text) == ids and auto(text, add_special_tokens=False)["input_ids"] == ids
    assert auto(text)["input_ids"] == [byte.bos_id, *ids]
    assert reloaded.decode([1, *ids, 2]) == text == auto.decode([1, *ids, 2], skip_special_tokens=True)


def test_check_fits_refuses_only_a_tokenizer_larger_than_the_model():
  check_fits(ByteTokenizer(), 259, "same size")
  check_fits(ByteTokenizer(), 512, "padded embeddings")
  with pytest.raises(ValueError, match=r"^model x: tokenizer vocab 259 > model vocab_size 200: ids 200\.\.258 have no "
                                       "embedding"):
    check_fits(ByteTokenizer(), 200, "model x")
