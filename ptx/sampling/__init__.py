"""In-graph sampling: prefill and decode over a sharded KV cache, sampling rules, shape buckets."""

from ptx.sampling.generation import LENGTH, STOP, Generation, generate, generate_padded
from ptx.sampling.rules import SamplingConfig, sample_tokens, truncated_logits

__all__ = ["LENGTH", "STOP", "Generation", "SamplingConfig", "generate", "generate_padded", "sample_tokens",
           "truncated_logits"]
