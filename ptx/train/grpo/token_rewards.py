"""Rewards computed in-graph from token arrays, for GRPO's fused mode.

A fused RL step samples, scores and updates in one jitted program, so its
reward is a JAX function of the generation and of task fields stored as
arrays. The host-side environments (`ptx.envs`) score text and
serve the host-reward mode and evaluations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ptx.data.tokenizer import Tokenizer
from ptx.sampling.generation import Generation


def encode_targets(tokenizer: Tokenizer, answers: list[str], width: int) -> np.ndarray:
  """Answer token ids followed by eos, right-padded with -1 to `width` columns (int32 [B, width]).

  Raises:
    ValueError: naming the answer that does not fit.
  """
  out = np.full((len(answers), width), -1, np.int32)
  for i, answer in enumerate(answers):
    ids = tokenizer.encode(answer) + [tokenizer.eos_id]
    if len(ids) > width:
      raise ValueError(f"answer {i} ({answer!r}) needs {len(ids)} tokens, more than {width}")
    out[i, :len(ids)] = ids
  return out


def exact_match(tokens_RN: jax.Array, lengths_R: jax.Array, targets_RA: jax.Array) -> jax.Array:
  """1.0 where a row generated exactly its target (answer then eos, from `encode_targets`), else 0.0.

  Args:
    tokens_RN: generated tokens [R, N].
    lengths_R: generated tokens per row, the stop token included [R].
    targets_RA: target ids padded with -1 [R, A], A <= N.
  """
  A = targets_RA.shape[1]
  n_target = (targets_RA >= 0).sum(axis=1)
  same = (tokens_RN[:, :A] == targets_RA) | (targets_RA < 0)
  return (jnp.all(same, axis=1) & (lengths_R == n_target)).astype(jnp.float32)


def target_reward(gen: Generation, task: dict[str, jax.Array]) -> jax.Array:
  """GRPO's in-graph exact-match reward: a Generation scored against `task["targets"]` (`encode_targets`)."""
  return exact_match(gen.tokens, gen.lengths, task["targets"])
