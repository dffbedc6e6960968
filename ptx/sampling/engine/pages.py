"""The host side of the paged KV cache: which pages are free, and how many rows hold each one.

A pool of P pages is split into D blocks, one per device along the batch axes
(`ptx.models.paged_kv_cache`); page ids are local to their block, and page 0 of
every block is its sink, never handed out. A page may be held by several rows
(the G samples of a prompt share its full pages): it returns to the free list
when the last of them releases it. Double releases and releases of pages never
handed out raise, so an engine bug cannot silently hand one page to two
sequences.
"""

from __future__ import annotations

import numpy as np

from ptx.models.paged_kv_cache import SINK_PAGE


class PageAllocator:
  """Free lists and reference counts of a pool's pages, per block."""

  def __init__(self, pages: int, blocks: int = 1):
    """Splits `pages` pages into `blocks` equal blocks, each with its own sink page.

    Raises:
      ValueError: if the pages do not split evenly, or a block would hold no
        page besides its sink.
    """
    if blocks < 1 or pages % blocks:
      raise ValueError(f"{pages} pages do not split into {blocks} blocks")
    self.pages_per_block = pages // blocks
    if self.pages_per_block < 2:
      raise ValueError(f"{pages} pages over {blocks} blocks leave no page besides each block's sink")
    # Lowest ids first (a stack whose top is the end), so allocation order is reproducible.
    self._free = [list(range(self.pages_per_block - 1, SINK_PAGE, -1)) for _ in range(blocks)]
    self._refs = np.zeros((blocks, self.pages_per_block), np.int32)
    self.peak_in_use = 0

  @property
  def blocks(self) -> int:
    """The number of blocks D."""
    return len(self._free)

  @property
  def capacity(self) -> int:
    """Pages each block can hand out (its sink excluded)."""
    return self.pages_per_block - 1

  @property
  def in_use(self) -> int:
    """Pages held by at least one row, over all blocks."""
    return int(np.count_nonzero(self._refs))

  def free_pages(self, block: int) -> int:
    """Pages of `block` free to allocate."""
    return len(self._free[block])

  def allocate(self, block: int, n: int) -> list[int]:
    """Hands out `n` free pages of `block`, each held once.

    Raises:
      ValueError: if the block has fewer than `n` free pages (nothing is taken).
    """
    if n > len(self._free[block]):
      raise ValueError(f"block {block} has {len(self._free[block])} free pages, {n} asked for")
    pages = [self._free[block].pop() for _ in range(n)]
    self._refs[block, pages] = 1
    self.peak_in_use = max(self.peak_in_use, self.in_use)
    return pages

  def share(self, block: int, pages: list[int]) -> None:
    """One more row holds each of `pages` (already handed out)."""
    self._check_held(block, pages, "share")
    np.add.at(self._refs[block], pages, 1)

  def release(self, block: int, pages: list[int]) -> None:
    """One row fewer holds each of `pages`; a page nobody holds returns to the free list."""
    self._check_held(block, pages, "release")
    for page in pages:
      self._refs[block, page] -= 1
      if self._refs[block, page] == 0:
        self._free[block].append(page)

  def _check_held(self, block: int, pages: list[int], action: str) -> None:
    # Counted as a multiset: releasing a page twice in one call needs two holders.
    ids, counts = np.unique(np.asarray(pages, np.int64), return_counts=True)
    if ids.size and (ids.min() <= SINK_PAGE or ids.max() >= self.pages_per_block):
      raise ValueError(f"cannot {action} pages {ids.tolist()} of block {block}: ids are 1..{self.capacity}")
    short = ids[self._refs[block, ids] < (counts if action == "release" else 1)]
    if short.size:
      raise ValueError(f"cannot {action} pages {short.tolist()} of block {block}: not held")
