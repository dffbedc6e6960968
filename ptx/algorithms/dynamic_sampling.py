"""DAPO dynamic sampling: B group slots filled, round after round, with the groups whose reward is not constant.

One implementation for both GRPO modes: the fused step calls it inside its
in-graph `while_loop` over sampling rounds, the host-reward step eagerly as
further batches arrive. Rows of a round are a pytree of [B, G, ...] arrays
(one group per leading index: rollout batch, generation, rewards).

  kept = start(rows_0)                       # round 0 fills the slots' contents
  kept = place(kept, rows_r, signal_r)       # each round's groups with signal
  rows, keep = flat(kept)                    # [B * G, ...] and keep [B * G]

Groups with signal take the next free slots in round order; slots still
free after the last round hold round 0's group of the same index with
keep = 0, so the loss trains on what was found and never crashes. The
metrics (`metrics`) count every sampled group, kept or not.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Kept(NamedTuple):
  """B group slots: their rows (a pytree of [B, G, ...]), which are filled, and how many."""

  rows: Any
  filled: jax.Array  # bool [B]
  count: jax.Array  # int32: filled slots (the next free one)


def start(rows: Any) -> Kept:
  """No slot filled yet; every slot holds round 0's group of its index until a kept group replaces it."""
  B = jax.tree.leaves(rows)[0].shape[0]
  return Kept(rows, jnp.zeros(B, bool), jnp.int32(0))


def place(kept: Kept, rows: Any, signal: jax.Array) -> Kept:
  """Puts the groups of `rows` whose `signal` [B] is True into the next free slots (those past B are dropped)."""
  B = signal.shape[0]
  slot = jnp.where(signal, kept.count + jnp.cumsum(signal) - 1, B)  # B is out of range: dropped
  placed = jax.tree.map(lambda b, x: b.at[slot].set(x, mode="drop"), kept.rows, rows)
  return Kept(placed, kept.filled.at[slot].set(True, mode="drop"), jnp.minimum(kept.count + signal.sum(), B))


def flat(kept: Kept) -> tuple[Any, jax.Array]:
  """(rows as [B * G, ...], keep int32 [B * G]: 1 for the rows of filled slots)."""
  G = jax.tree.leaves(kept.rows)[0].shape[1]
  rows = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), kept.rows)
  return rows, jnp.repeat(kept.filled, G).astype(jnp.int32)


def metrics(kept: Kept, *, sampled: jax.Array, with_signal: jax.Array, rounds: jax.Array) -> dict[str, jax.Array]:
  """The spec's `filter_groups/*` metrics of a step that sampled `sampled` groups in `rounds` rounds.

  Args:
    kept: the slots after the last round.
    sampled: groups sampled over all rounds.
    with_signal: groups with signal among them (kept or beyond the B slots).
    rounds: sampling rounds run, the first included.
  """
  B = kept.filled.shape[0]
  sampled = jnp.asarray(sampled, jnp.float32)
  with_signal = jnp.asarray(with_signal, jnp.float32)
  return {"filter_groups/evicted": sampled - with_signal, "filter_groups/pass_rate": with_signal / sampled,
          "filter_groups/rounds": jnp.asarray(rounds, jnp.float32),
          "filter_groups/unfilled": (B - kept.filled.sum()).astype(jnp.float32)}
