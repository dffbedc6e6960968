"""Chat records with images: ids, pixels and masks equal transformers' Idefics3 processor's on SmolVLM's template;
image tokens never train; bad images are errors at file:line; truncation and packing keep images whole."""

import base64
import io
import json
import re

import numpy as np
import pytest
from image_vocab import image_vocab
from PIL import Image
from transformers import PreTrainedTokenizerFast
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

from ptx.data.batch import pack_rows
from ptx.data.batcher import fit
from ptx.data.chat import JinjaChatTemplate
from ptx.data.hf_tokenizer import HFTokenizer
from ptx.data.image_tokens import image_token_id
from ptx.data.images import ImageConfig
from ptx.data.records import RecordError, decode, encode
from ptx.data.sources import JsonlSource

CFG = ImageConfig(longest_edge=96, tile_size=32, image_seq_len=3)
TOK = HFTokenizer(image_vocab(), eos_token="<|endoftext|>")
SMOLVLM = JinjaChatTemplate(DEFAULT_CHAT_TEMPLATE)


def _png(height: int, width: int, seed: int) -> bytes:
  pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
  out = io.BytesIO()
  Image.fromarray(pixels).save(out, "PNG")
  return out.getvalue()


def _conversation(first_image: dict, second_image: dict) -> list[dict]:
  return [{"role": "user", "content": [first_image, {"type": "text", "text": "What is in this image?"}]},
          {"role": "assistant", "content": "Two cats."},
          {"role": "user", "content": [{"type": "text", "text": "And here?"}, second_image]},
          {"role": "assistant", "content": "A mat."}]


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
  folder = tmp_path_factory.mktemp("images")
  (folder / "wide.png").write_bytes(_png(20, 30, 0))
  return folder / "wide.png", _png(9, 70, 1)


def test_a_record_equals_the_processor_on_smolvlms_template(pngs):
  path, data = pngs
  record = {"messages": _conversation({"type": "image", "path": str(path)},
                                      {"type": "image", "bytes": base64.b64encode(data).decode()})}
  got = encode("sft", TOK, record, "memory[0]", SMOLVLM, images=CFG)

  fast = PreTrainedTokenizerFast(tokenizer_object=image_vocab(), eos_token="<|endoftext|>")
  processor = Idefics3Processor(
      image_processor=Idefics3ImageProcessorPil(size={"longest_edge": 96}, max_image_size={"longest_edge": 32}),
      tokenizer=fast, image_seq_len=3)
  placeholders = _conversation({"type": "image"}, {"type": "image"})
  text = processor.apply_chat_template(placeholders, chat_template=DEFAULT_CHAT_TEMPLATE)
  want = processor(text=[text], images=[[Image.open(path), Image.open(io.BytesIO(data))]])
  assert got["tokens"].tolist() == want["input_ids"][0]
  # Same PIL resizes, same float32 operations: bit-identical.
  np.testing.assert_array_equal(got["pixel_values"], want["pixel_values"][0])
  assert want["pixel_attention_mask"][0].all()

  targets = TOK.decode(got["tokens"][got["loss_mask"] == 1])
  assert targets == " Two cats. A mat."  # the replies and their <end_of_utterance>, which decode drops
  image_id = image_token_id(TOK)
  slots = got["image_slots"]
  np.testing.assert_array_equal(slots >= 0, got["tokens"] == image_id)
  np.testing.assert_array_equal(slots[slots >= 0], np.arange(len(got["pixel_values"]) * 3))


def test_an_image_in_a_reply_is_not_trained_on(pngs):
  path, _ = pngs
  record = {"messages": [{"role": "user", "content": "Draw it."},
                         {"role": "assistant", "content": [{"type": "text", "text": "Here:"},
                                                           {"type": "image", "path": str(path)}]}]}
  got = encode("sft", TOK, record, "memory[0]", images=CFG)  # ChatML renders the image part as <image>
  image_id = image_token_id(TOK)
  assert (got["tokens"] == image_id).sum() == 7 * 3
  assert got["loss_mask"][got["image_slots"] >= 0].sum() == 0
  assert TOK.decode(got["tokens"][got["loss_mask"] == 1]) == "Here:"  # and <|im_end|>, which decode drops
  assert got["loss_mask"][-2] == 1  # <|im_end|> closing the reply, after the image


def test_parts_of_text_alone_carry_no_tiles():
  parts = [{"type": "text", "text": "Describe "}, {"type": "text", "text": "both."}]
  record = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "Two cats."}]}
  got = encode("sft", TOK, record, "memory[0]", images=CFG)
  want = encode("sft", TOK, {"messages": [{"role": "user", "content": "Describe both."}, record["messages"][1]]},
                "memory[0]")
  np.testing.assert_array_equal(got["tokens"], want["tokens"])
  np.testing.assert_array_equal(got["loss_mask"], want["loss_mask"])
  assert (got["image_slots"] == -1).all() and got["pixel_values"].shape == (0, 3, 32, 32)
  assert fit(got, "sft", len(got["tokens"]) - 1, "truncate", "memory[0]")["status"] == "truncated"


def _bad_records(tmp_path, pngs) -> list[tuple[dict, str]]:
  path, data = pngs
  (tmp_path / "empty.png").write_bytes(b"")
  image = {"type": "image", "path": str(path)}
  return [
      (_conversation({"type": "image", "path": str(tmp_path / "missing.png")}, image),
       f"messages[0].content[0].path: no such file '{tmp_path / 'missing.png'}'"),
      (_conversation(image, {"type": "image", "bytes": base64.b64encode(data[:50]).decode()}),
       "messages[2].content[1].bytes: cannot decode image: image file is truncated"),
      (_conversation(image, {"type": "image", "path": str(tmp_path / "empty.png")}),
       f"messages[2].content[1].path '{tmp_path / 'empty.png'}': cannot decode image: not an image format PIL reads, "
       "or one of zero size"),
      (_conversation(image, {"type": "image", "bytes": "not base64!"}), "messages[2].content[1].bytes is not base64"),
      (_conversation(image, {"type": "image", "url": "https://x/y.png"}),
       "messages[2].content[1]: an image part needs one string field, 'path' or 'bytes' (base64)"),
      (_conversation(image, {"type": "text", "text": "a literal <image>"}),
       "messages: the rendering holds more <image> placeholders than the 1 image parts (is <image> written in a "
       "text part?)"),
      (_conversation(image, {"type": "audio"}), "messages[2].content[1] must be an object of type"),
  ]


def test_bad_images_are_errors_at_file_and_line(tmp_path, pngs):
  bad = _bad_records(tmp_path, pngs)
  good = {"messages": _conversation(*[{"type": "image", "path": str(pngs[0])}] * 2)}
  lines = [json.dumps(good)] + [json.dumps({"messages": messages}) for messages, _ in bad]
  (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
  source = JsonlSource(tmp_path / "data.jsonl")
  assert encode("sft", TOK, decode(source[0]), source[0].where, SMOLVLM, images=CFG)["tokens"].size
  for i, (_, message) in enumerate(bad, 1):
    with pytest.raises(RecordError, match="^" + re.escape(f"{tmp_path / 'data.jsonl'}:{i + 1}: {message}")):
      encode("sft", TOK, decode(source[i]), source[i].where, SMOLVLM, images=CFG)
  with pytest.raises(RecordError, match="data.jsonl:1: field 'messages' holds content parts, which need images on: "
                                        "data.tiles_per_row"):
    encode("sft", TOK, decode(source[0]), source[0].where, SMOLVLM)


def _example(path) -> dict:
  record = {"messages": [{"role": "user", "content": "Describe both."},
                         {"role": "assistant", "content": "Two cats."},
                         {"role": "user", "content": [{"type": "image", "path": str(path)},
                                                      {"type": "text", "text": "What is in this image?"}]},
                         {"role": "assistant", "content": "A mat."}]}
  return encode("sft", TOK, record, "memory[0]", images=CFG)


def test_truncation_keeps_an_image_whole_or_drops_the_record(pngs):
  example = _example(pngs[0])
  n = len(example["tokens"])
  image_end = int(np.flatnonzero(example["image_slots"] >= 0)[-1]) + 2  # the closing <fake_token_around_image>
  assert example["tokens"][image_end - 1] == TOK.encode("<fake_token_around_image>")[0]
  cut = fit({k: v.copy() for k, v in example.items()}, "sft", n - 2, "truncate", "memory[0]", 7)
  assert cut["status"] == "truncated" and len(cut["example"]["image_slots"]) == n - 2
  dropped = fit({k: v.copy() for k, v in example.items()}, "sft", image_end - 1, "truncate", "memory[0]", 7)
  assert dropped["status"] == "dropped" and "would cut the image" in dropped["reason"]


def test_packing_moves_slots_past_the_images_before_them(pngs):
  first, second = _example(pngs[0]), _example(pngs[0])
  text = {"tokens": np.arange(5, dtype=np.int32), "loss_mask": np.ones(5, np.int32)}
  batch = pack_rows([[first, text, second], []], 300, 0, tiles_per_row=15, tile_size=32)
  a, b = len(first["tokens"]), len(second["tokens"])
  slots = batch["image_slots"]
  np.testing.assert_array_equal(slots[0, :a], first["image_slots"])
  assert (slots[0, a:a + 5] == -1).all() and (slots[1] == -1).all()
  rows = 7 * 3  # the first example's feature rows: 7 tiles of 3 tokens
  np.testing.assert_array_equal(slots[0, a + 5:a + 5 + b], np.where(second["image_slots"] >= 0,
                                                                    second["image_slots"] + rows, -1))
  np.testing.assert_array_equal(batch["pixel_values"][0, :14], np.concatenate([first["pixel_values"]] * 2))
  assert batch["pixel_values"].shape == (2, 15, 3, 32, 32) and not batch["pixel_values"][0, 14:].any()
  np.testing.assert_array_equal(batch["pixel_attention_mask"][:, :, 0, 0], [[1] * 14 + [0], [0] * 15])
  with pytest.raises(ValueError, match="row 0: 2 images have 14 tiles, more than the 13"):
    pack_rows([[first, second]], 300, 0, tiles_per_row=13, tile_size=32)
  with pytest.raises(ValueError, match="need tiles_per_row"):
    pack_rows([[first]], 300, 0)
