"""TextSampler: text in, text out, on a tokenizer that fits the model."""

import dataclasses

import pytest

from ptx.data.tokenizer import ByteTokenizer
from ptx.sampling.text import TextSampler


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tiny_config):
  small = dataclasses.replace(tiny_config, vocab_size=256)
  with pytest.raises(ValueError, match="TextSampler: tokenizer vocab 259 > model vocab_size 256"):
    TextSampler(None, small, ByteTokenizer(), max_new_tokens=4)
  assert TextSampler(None, tiny_config, ByteTokenizer(), max_new_tokens=4).encode("hi") == [1, 107, 108]
