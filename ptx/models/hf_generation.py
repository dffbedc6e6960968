"""What an HF directory declares for generation: special-token ids, context length, sampling defaults.

transformers reads `bos_token_id`, `eos_token_id`, `pad_token_id` and
`max_position_embeddings` from config.json and `generate`'s defaults from
generation_config.json; where they are missing it falls back to the class's
defaults (Llama's eos is 2, its context 2048), so a plain `generate` runs
past the model's real end token. ptx's `ModelConfig` holds none of this
(the decoder needs none of it), so it travels beside the weights as a
`GenerationInfo`:

- `read_generation(dir)`: what an HF directory's config.json and
  generation_config.json declare (the GGUF converter writes them from the
  GGUF metadata, so a converted directory declares what the GGUF did);
- `with_tokenizer(generation, tokenizer)`: the tokenizer's ids first, since
  ptx's sampler stops on the tokenizer's eos;
- `GenerationInfo.config_keys()` / `generation_config()`: what `save_hf` writes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ptx import paths
from ptx.models.hf_config import FAMILIES, HFConfigError

_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclasses.dataclass(frozen=True)
class GenerationInfo:
  """Special-token ids, context length and sampling defaults of an HF model directory."""

  # Token the tokenizer puts first (None: none).
  bos_token_id: int | None = None
  # Tokens that end a generation, the tokenizer's eos first (transformers stops on any of them).
  eos_token_ids: tuple[int, ...] = ()
  # Token that pads a batch (None: none declared).
  pad_token_id: int | None = None
  # Longest sequence the model is declared for (None: none declared; transformers then uses its class default).
  max_position_embeddings: int | None = None
  # generation_config.json's other keys (do_sample, temperature, top_p, ...), as the source wrote them.
  defaults: dict[str, Any] = dataclasses.field(default_factory=dict)

  def config_keys(self) -> dict[str, Any]:
    """The config.json keys of this generation info (undeclared ones left out)."""
    keys = {**self._ids(), "max_position_embeddings": self.max_position_embeddings}
    return {k: v for k, v in keys.items() if v is not None}

  def generation_config(self) -> dict[str, Any]:
    """The generation_config.json dict: the sampling defaults and the special-token ids."""
    return {**self.defaults, **{k: v for k, v in self._ids().items() if v is not None}}

  def _ids(self) -> dict[str, Any]:
    # transformers writes a single eos as an int and several as a list; both load.
    eos = None if not self.eos_token_ids else (
        self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids))
    return {"bos_token_id": self.bos_token_id, "eos_token_id": eos, "pad_token_id": self.pad_token_id}


def read_generation(path: str | os.PathLike) -> GenerationInfo:
  """Reads the generation info an HF model directory declares.

  Args:
    path: a directory, local or gs://, with config.json and, optionally,
      generation_config.json (whose ids win, as in transformers' `generate`).

  Returns:
    The GenerationInfo; what neither file declares is None (or empty).

  Raises:
    HFConfigError: naming the file and key of an id or length that is not an
      integer (or, for eos_token_id, a list of them).
    FileNotFoundError: when the directory has no config.json.
  """
  path = paths.path(path)
  config_file, generation_file = path / "config.json", path / "generation_config.json"
  config = json.loads(config_file.read_text())
  family = FAMILIES.get(config.get("model_type"))
  if family is not None and family.nested:  # a multimodal config keeps the text model's keys inside
    config = {**(config.get(family.nested) or {}), **{k: v for k, v in config.items() if v is not None}}
  generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}

  def declared(key: str, *files: tuple[paths.Path, dict]) -> tuple[int, ...]:
    for where, keys in files:
      if keys.get(key) is not None:
        return _ints(keys[key], where, key, many=key == "eos_token_id")
    return ()

  both = ((generation_file, generation), (config_file, config))
  bos, pad = declared("bos_token_id", *both), declared("pad_token_id", *both)
  length = declared("max_position_embeddings", (config_file, config))
  return GenerationInfo(bos_token_id=bos[0] if bos else None, eos_token_ids=declared("eos_token_id", *both),
                        pad_token_id=pad[0] if pad else None, max_position_embeddings=length[0] if length else None,
                        defaults={k: v for k, v in generation.items() if k not in _IDS and k != "transformers_version"})


def with_tokenizer(generation: GenerationInfo, tokenizer: Any) -> GenerationInfo:
  """`generation` with the tokenizer's special-token ids, which are the ones ptx itself uses.

  Args:
    generation: what the source checkpoint declared (`GenerationInfo()` for a
      fresh model).
    tokenizer: a ptx `Tokenizer` (its `eos_id`, `bos_id` and `pad_id`).

  Returns:
    The GenerationInfo whose first eos is the tokenizer's, followed by the other
    ends the source declared (Llama 3 Instruct ends on three tokens); bos and
    pad are the tokenizer's where it has them.
  """
  eos = (tokenizer.eos_id, *[i for i in generation.eos_token_ids if i != tokenizer.eos_id])
  bos = tokenizer.bos_id if tokenizer.bos_id is not None else generation.bos_token_id
  return dataclasses.replace(generation, bos_token_id=bos, eos_token_ids=eos, pad_token_id=tokenizer.pad_id)


def _ints(value: Any, where: paths.Path, key: str, *, many: bool) -> tuple[int, ...]:
  """A non-negative int (or, with `many`, a list of them) as a tuple; anything else raises naming `key`."""
  values = value if many and isinstance(value, list) else [value]
  if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
    kind = "a non-negative integer" + (" or a list of them" if many else "")
    raise HFConfigError(f"{where}: {key} must be {kind}, got {value!r}")
  return tuple(values)
