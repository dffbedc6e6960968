"""Text in, text out: the sampler behind evaluations and host-scored rewards.

`TextSampler(prompts, k)` tokenizes each prompt (plainly, or as a user turn
through the tokenizer's chat template), samples k continuations per prompt
with `ptx.sampling.generate` (each prompt prefilled once for its k samples),
or on a rollout engine when given one (`ptx.sampling.engine.mode`'s fast
mode), and decodes them up to, not including, the stop token. It is the
`generate(prompts, k)` callable of `ptx.episodes.evaluation.evaluate`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.data.chat import encode_chat
from ptx.data.tokenizer import Tokenizer, check_fits
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.generation import generate
from ptx.sampling.rules import SamplingConfig


def prompt_ids(tokenizer: Tokenizer, prompt: str, *, chat: bool) -> list[int]:
  """The token ids a `TextSampler` feeds for `prompt`: a user turn of the chat template with the assistant header
  (`chat`), else bos and the text."""
  if chat:
    return encode_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)[0]
  bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
  return bos + tokenizer.encode(prompt)


class TextSampler:
  """Samples text continuations of text prompts from a parameter tree.

  Args:
    params: the decoder parameters (placed on `mesh` when given).
    cfg: the model config.
    tokenizer: encodes prompts and decodes completions.
    max_new_tokens: the length budget of a completion.
    sampling: temperature / top-k / top-p / min-p.
    seed: call i samples with `fold_in(key(seed), i)`, so a run is reproducible.
    chat: render each prompt as a user turn of the tokenizer's chat template.
    mesh: sample sharded on this mesh.
    stop_ids: ids that end a completion; defaults to the tokenizer's eos.
    rules: the sharding rules `params` were placed by (a Job's `rules`).
    engine: sample on this rollout engine (built with the sampling and seed
      it should use, `sampling` and `seed` then unused), its shapes holding
      k samples of the longest prompt plus `max_new_tokens`; else `generate`.
      An attribute: it may be set after construction, once `encode` has
      measured the prompts.

  Raises:
    ValueError: when the tokenizer has more tokens than the model's vocab_size.
  """

  def __init__(self, params: Any, cfg: ModelConfig, tokenizer: Tokenizer, *, max_new_tokens: int,
               sampling: SamplingConfig = SamplingConfig(), seed: int = 0, chat: bool = False,
               mesh: Mesh | None = None, stop_ids: Sequence[int] | None = None,
               rules: sharding.Rules = sharding.DEFAULT_RULES, engine: RolloutEngine | None = None):
    check_fits(tokenizer, cfg.vocab_size, "TextSampler")
    self.params, self.cfg, self.tokenizer = params, cfg, tokenizer
    self.max_new_tokens, self.sampling, self.chat, self.mesh, self.rules = max_new_tokens, sampling, chat, mesh, rules
    self.stop_ids = list(stop_ids) if stop_ids is not None else [tokenizer.eos_id]
    self.engine = engine
    self._key = jax.random.key(seed)
    self._calls = 0

  def encode(self, prompt: str) -> list[int]:
    """The prompt's token ids, as the model will see them."""
    return prompt_ids(self.tokenizer, prompt, chat=self.chat)

  def __call__(self, prompts: list[str], k: int) -> list[list[str]]:
    """k completions of every prompt, in prompt order."""
    encoded = [self.encode(p) for p in prompts]
    if self.engine is not None:
      rows = self._on_engine(encoded, k)
    else:
      rng = jax.random.fold_in(self._key, self._calls)
      self._calls += 1
      out = generate(self.params, encoded, cfg=self.cfg, max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                     rng=rng, stop_ids=self.stop_ids, group_size=k, mesh=self.mesh, pad_id=self.tokenizer.pad_id,
                     rules=self.rules)
      rows = [row[:n] for row, n in zip(np.asarray(out.tokens), np.asarray(out.lengths))]
    texts = [self.tokenizer.decode([t for t in row if t not in self.stop_ids]) for row in rows]
    return [texts[i * k:(i + 1) * k] for i in range(len(prompts))]

  def _on_engine(self, encoded: list[list[int]], k: int) -> list[np.ndarray]:
    """The k sampled token rows of every prompt, in prompt order, from the engine."""
    ids = [self.engine.submit(p, max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids, samples=k)
           for p in encoded]
    done = self.engine.run(self.params)
    return [np.asarray(done[i].tokens) for group in ids for i in group]
