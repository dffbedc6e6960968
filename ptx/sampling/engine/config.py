"""The rollout engine's static shapes, and how they are sized for a workload and a mesh.

Its own module so that the engine and its admission policy both read it
without importing each other; training, evaluation and distillation size
their engines through `EngineConfig.sized` and `on_mesh` alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jax.sharding import Mesh

from ptx import sharding
from ptx.models import paged_kv_cache


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """The engine's static shapes; its programs compile for these."""

  # Sequences decoded together; a multiple of the devices along the batch axes.
  max_seqs: int = 64
  # Pages in the pool, every block's sink page included; a multiple of the devices along the batch axes.
  pages: int = 1024
  # Token positions per page.
  page_size: int = 16
  # Cached positions one sequence may take: its prompt, the tokens it generates and what `extend` appends.
  max_seq_len: int = 4096
  # Tokens each decode call generates per row at most: the host admits and releases between calls.
  decode_steps: int = 16
  # Tokens each prefill call writes per row: prefill memory grows with it, not with the prompt.
  prefill_chunk: int = 64
  # Rows each prefill call writes; a multiple of the devices along the batch axes.
  prefill_rows: int = 8
  # K/V page storage: "auto" (the model's compute dtype) or "int8" (per-slot, per-head scales; about half of
  # bfloat16's bytes, so about twice the sequences in the same memory; `ptx.models.paged_kv_cache`).
  kv_dtype: Literal["auto", "int8"] = "auto"
  # Pages a request takes at admission: "reserve" (its whole budget; never preempted) or "on_demand" (its prompt
  # and next call, growing call by call; the last submitted are preempted and recomputed when pages run out).
  admission: Literal["reserve", "on_demand"] = "reserve"

  def __post_init__(self):
    for name in ("max_seqs", "pages", "page_size", "max_seq_len", "decode_steps", "prefill_chunk", "prefill_rows"):
      if getattr(self, name) < 1:
        raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.kv_dtype not in ("auto", "int8"):
      raise ValueError(f"EngineConfig.kv_dtype must be 'auto' or 'int8', got {self.kv_dtype!r}")
    if self.admission not in ("reserve", "on_demand"):
      raise ValueError(f"EngineConfig.admission must be 'reserve' or 'on_demand', got {self.admission!r}")
    if self.page_size > 4096:
      raise ValueError(f"EngineConfig.page_size must be <= 4096 (int32 positions of padding pairs), got "
                       f"{self.page_size}")

  @property
  def pages_per_seq(self) -> int:
    """Pages one sequence may hold: its page table's width."""
    return -(-self.max_seq_len // self.page_size)

  @classmethod
  def sized(cls, seqs: int, seq_len: int, *, pages: int = 0, **fields: Any) -> EngineConfig:
    """An engine of `seqs` slots for sequences of up to `seq_len` positions.

    Args:
      seqs: slots (`max_seqs`).
      seq_len: positions one sequence may take (`max_seq_len`).
      pages: the pool's pages; 0 holds every slot's sequence at its worst
        case plus the sink page, so admission never waits for pages.
      **fields: the other EngineConfig fields.

    Returns:
      The EngineConfig.
    """
    page_size = fields.get("page_size", cls.page_size)
    return cls(max_seqs=seqs, max_seq_len=seq_len, pages=pages or seqs * -(-seq_len // page_size) + 1, **fields)

  def on_blocks(self, blocks: int) -> EngineConfig:
    """These shapes over `blocks` device blocks: slots and prefill rows rounded up to a multiple of `blocks`, and
    pages rounded up after a sink page for each block beyond the first."""
    up = lambda n: -(-n // blocks) * blocks  # noqa: E731
    return dataclasses.replace(self, max_seqs=up(self.max_seqs), prefill_rows=up(self.prefill_rows),
                               pages=up(self.pages + blocks - 1))

  def on_mesh(self, mesh: Mesh, rules: sharding.Rules) -> EngineConfig:
    """These shapes for `mesh`: `on_blocks` of the devices that split the batch (`paged_kv_cache.page_blocks`)."""
    return self.on_blocks(paged_kv_cache.page_blocks(self.pages, mesh, rules))
