"""The lm-evaluation-harness model `ptx`: a ptx model on the device mesh, driven by `lm_eval`.

`PtxLM` answers lm_eval's three request types with ptx's own programs:
`loglikelihood` and `loglikelihood_rolling` through
`ptx.episodes.likelihood.Scorer` (the same scores as `ptx eval --task
choice|perplexity`), `generate_until` through `ptx.sampling.text.TextSampler`
(greedy unless the task asks for a temperature with `do_sample`; each
completion stops at eos or `max_gen_toks` tokens and is cut before the first
of its `until` strings). Parameters are placed on a mesh of every device
(`ptx.config.MeshConfig`'s default: FSDP) and batches split over it.

lm_eval 0.4.13 finds a model by name only in its own table
(`lm_eval.models.MODEL_MAPPING`) or among those registered in the running
process (`lm_eval.api.registry.register_model`); it reads no entry points,
so an installed package cannot add `--model ptx` to the `lm_eval` command.
This module registers `ptx` when imported, and as a program runs lm_eval's
own command line with its arguments:

  python -m ptx.lm_eval_model run --model ptx --model_args model=DIR --batch_size 16 --tasks hellaswag

model_args: `model`, an HF directory (local or gs://) or a `.gguf` file
(converted to a float32 HF directory in a temporary directory);
`max_length` (positions a scored
or generated sequence spans; default: the model's declared context, else
`likelihood.WINDOW`); `max_gen_toks` (default 256); `seed` (of sampled
generations). lm_eval's `--batch_size` is the rows per call ("auto": 16;
on a mesh rounded up to a multiple of its devices). Chat templates are not applied (`--apply_chat_template` is
refused by lm_eval for a model without one).
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ptx import paths, sharding
from ptx.config import MeshConfig
from ptx.data.hf_tokenizer import load_tokenizer
from ptx.episodes import likelihood
from ptx.models import load_hf
from ptx.models.hf_generation import read_generation
from ptx.sampling.rules import SamplingConfig
from ptx.sampling.text import TextSampler


@register_model("ptx")
class PtxLM(LM):
  """A ptx model as an lm_eval `LM` (see the module docstring for its model_args).

  Args:
    model: an HF model directory or a `.gguf` file.
    batch_size: rows per call, lm_eval's `--batch_size` ("auto" or None: 16).
    max_length: positions a sequence may span (None: the model's declared context).
    max_gen_toks: the default length budget of `generate_until`.
    seed: the seed of sampled generations.
    **unused: lm_eval's other constructor arguments (`device`, `max_batch_size`): the mesh decides.
  """

  def __init__(self, model: str, batch_size: int | str | None = 16, max_length: int | None = None,
               max_gen_toks: int = 256, seed: int = 0, **unused: Any):
    super().__init__()
    del unused
    path = paths.path(model)
    if path.suffix == ".gguf":
      from ptx.models.gguf import convert_gguf  # the gguf extra; only a .gguf model needs it

      self._converted = tempfile.TemporaryDirectory(prefix="ptx_lm_eval_")
      path = convert_gguf(path, self._converted.name, dtype="float32")
    mesh, rules = sharding.make_mesh(MeshConfig()), sharding.DEFAULT_RULES
    decoder = load_hf(path, mesh=mesh, rules=rules)
    length = int(max_length or read_generation(path).max_position_embeddings or likelihood.WINDOW)
    rows = 16 if batch_size in (None, "auto") else int(batch_size)
    self.scorer = likelihood.Scorer(decoder.params, decoder.cfg, load_tokenizer(path), max_length=length,
                                    batch_size=rows, mesh=mesh, rules=rules)
    self.max_gen_toks, self.seed = int(max_gen_toks), int(seed)

  def loglikelihood(self, requests) -> list[tuple[float, bool]]:
    """(log p(continuation | context), is greedy) of each request's (context, continuation)."""
    results = self.scorer.loglikelihood([r.args for r in requests])
    for request, result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood", request.args, result)
    return results

  def loglikelihood_rolling(self, requests) -> list[float]:
    """The log-likelihood of each request's whole text, scored in disjoint windows of `max_length`."""
    results = self.scorer.rolling([r.args[0] for r in requests])
    for request, result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, result)
    return results

  def generate_until(self, requests) -> list[str]:
    """The completion of each request's (context, gen_kwargs), cut before its first `until` string.

    Raises:
      ValueError: a prompt that leaves fewer than `max_gen_toks` positions of `max_length`.
    """
    out: list[str | None] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for index, request in enumerate(requests):  # one sampler per distinct gen_kwargs
      groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
    for indices in groups.values():
      kwargs = dict(requests[indices[0]].args[1])
      until = kwargs.get("until") or []
      until = [until] if isinstance(until, str) else list(until)
      budget = int(kwargs.get("max_gen_toks", self.max_gen_toks))
      temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
      sampling = SamplingConfig(greedy=True) if temperature == 0 else SamplingConfig(temperature=temperature)
      sampler = TextSampler(self.scorer.params, self.scorer.cfg, self.scorer.tokenizer, max_new_tokens=budget,
                            sampling=sampling, seed=self.seed, mesh=self.scorer.mesh, rules=self.scorer.rules)
      for start in range(0, len(indices), self.scorer.batch_size):
        chunk = indices[start:start + self.scorer.batch_size]
        prompts = [requests[i].args[0] for i in chunk]
        for i, prompt in zip(chunk, prompts):
          if len(sampler.encode(prompt)) + budget > self.scorer.max_length:
            raise ValueError(f"generate_until: request {i}'s prompt and max_gen_toks {budget} pass max_length "
                             f"{self.scorer.max_length}")
        for i, (text,) in zip(chunk, sampler(prompts, 1)):
          out[i] = min((text.split(stop)[0] for stop in until), key=len, default=text)
          self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
    return out


def main(argv: list[str] | None = None) -> None:
  """Runs lm_eval's command line (`argv`, default sys.argv[1:]) with the model `ptx` registered."""
  from lm_eval.__main__ import cli_evaluate

  from ptx import compile_cache

  compile_cache.enable()  # before anything compiles
  sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
  cli_evaluate()


if __name__ == "__main__":
  main()
