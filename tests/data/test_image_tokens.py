"""Image-token expansion and ids equal transformers' Idefics3 / SmolVLM processors'; slots index feature rows."""

import io

import numpy as np
import pytest
from image_vocab import image_vocab
from PIL import Image
from transformers import PreTrainedTokenizerFast
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from ptx.data import image_tokens
from ptx.data.hf_tokenizer import HFTokenizer
from ptx.data.images import ImageConfig, load, tile
from ptx.data.tokenizer import ByteTokenizer

CFG = ImageConfig(longest_edge=96, tile_size=32, image_seq_len=3)
VOCAB = image_vocab()
TOK = HFTokenizer(VOCAB, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def processor():
  fast = PreTrainedTokenizerFast(tokenizer_object=image_vocab(), eos_token="<|endoftext|>")
  image_processor = Idefics3ImageProcessorPil(size={"longest_edge": CFG.longest_edge},
                                              max_image_size={"longest_edge": CFG.tile_size})
  return Idefics3Processor(image_processor=image_processor, tokenizer=fast, image_seq_len=CFG.image_seq_len)


@pytest.mark.parametrize("rows, cols", [(0, 0), (1, 1), (2, 3), (3, 2), (6, 6)])
def test_expansion_is_the_processors_text(rows, cols, processor):
  want = get_image_prompt_string(rows, cols, 5, "<fake_token_around_image>", "<image>", "<global-img>")
  assert image_tokens.expansion(rows, cols, 5) == want
  processor.image_seq_len = 5
  assert image_tokens.expansion(rows, cols, 5) == processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
  processor.image_seq_len = CFG.image_seq_len


def test_ids_equal_the_processors(processor):
  rng = np.random.default_rng(0)
  images = [Image.fromarray(rng.integers(0, 256, size + (3,), dtype=np.uint8)) for size in [(20, 30), (9, 70)]]
  text = "User:<image>What is in this image?\n<image> Describe both.<end_of_utterance>\nAssistant: Two cats."
  want = processor(text=[text], images=[images])
  tiles = [tile(load_rgb(im), CFG) for im in images]
  assert [(t.rows, t.cols) for t in tiles] == [(2, 3), (1, 3)]
  pieces = text.split(image_tokens.IMAGE)
  ids = TOK.encode(pieces[0])
  for t, piece in zip(tiles, pieces[1:]):
    ids += image_tokens.encode_expansion(TOK, t.rows, t.cols, CFG.image_seq_len) + TOK.encode(piece)
  assert ids == want["input_ids"][0]
  slots = image_tokens.image_slots(np.asarray(ids), image_tokens.image_token_id(TOK))
  tiles_total = sum(len(t.pixel_values) for t in tiles)
  # One slot per feature row of every tile, in order, and nowhere else.
  np.testing.assert_array_equal(slots[slots >= 0], np.arange(tiles_total * CFG.image_seq_len))
  assert tiles_total == want["pixel_values"].shape[1] == 7 + 4


def test_image_slots_count_along_the_last_axis():
  tokens = np.asarray([[5, 9, 9, 1, 9], [9, 2, 2, 9, 9]])
  np.testing.assert_array_equal(image_tokens.image_slots(tokens, 9), [[-1, 0, 1, -1, 2], [0, -1, -1, 1, 2]])


def test_a_tokenizer_without_the_image_tokens_is_refused():
  with pytest.raises(ValueError, match="encodes '<image>' as 7 tokens"):
    image_tokens.encode_expansion(ByteTokenizer(), 0, 0, 3)


def load_rgb(image: Image.Image) -> Image.Image:
  """The image through `load`, as a record's bytes would come."""
  out = io.BytesIO()
  image.save(out, "PNG")
  return load(out.getvalue())
