"""A tiny byte-level BPE vocabulary holding the Idefics3 / SmolVLM image tokens, as a hub tokenizer holds them."""

import tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>", "<global-img>",
            "<end_of_utterance>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]


def image_vocab() -> tokenizers.Tokenizer:
  """A `tokenizers.Tokenizer` of 400 ids whose special tokens are SPECIALS."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIALS, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["User: What is in this image?\n\nAssistant: Two cats on a mat.", "Describe both."], trainer)
  return tok
