"""The rollout engine's admission: which sequences hold slots and pages, how they grow, and who is preempted.

`RolloutEngine` keeps one `Admission`. It owns the slots, the page allocator
and three queues (held sequences' `extend`s, preempted sequences by seq_id,
submitted groups in order) and moves sequences between them; the engine runs
the programs over whatever it admitted. The two kinds of
`EngineConfig.admission` differ only here:

  reserve    a group is admitted with the pages of its prompt and whole
             budget (`HostSequence.reserve`): it never waits for a page and
             is never preempted
  on_demand  a group is admitted with the pages of its prompt and its next
             call, leaving each growing sequence's next call room in its
             block; before every step `make_room` gives each growing sequence
             (oldest first) the pages its next call may fill, preempting the
             youngest of its block where pages run out

A preempted sequence gives back its slot and pages and keeps its turn and RNG
counter; its cached tokens go back to its feed (`HostSequence.uncache`), so
it is prefilled again when admitted, ahead of every queued group. Sequences
held for `extend` (keep=True) reserve in both kinds.
"""

from __future__ import annotations

import bisect
import collections

from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.pages import PageAllocator
from ptx.sampling.engine.sequences import HostSequence, SeqState


class Admission:
  """The slots, pages and queues of one engine's sequences (see the module docstring)."""

  def __init__(self, config: EngineConfig, blocks: int):
    """Free slots and pages for `config`, split into `blocks` blocks (one per device along the batch axes)."""
    self.config = config
    self.allocator = PageAllocator(config.pages, blocks)
    self.slots_per_block = config.max_seqs // blocks
    self.slots: list[HostSequence | None] = [None] * config.max_seqs
    self._free_slots = [list(range((b + 1) * self.slots_per_block - 1, b * self.slots_per_block - 1, -1))
                        for b in range(blocks)]
    self.queue: collections.deque[list[HostSequence]] = collections.deque()  # groups, in submission order
    self.extends: collections.deque[HostSequence] = collections.deque()
    self.preempted: list[HostSequence] = []  # by seq_id: admitted before any queued group
    self.preemptions = 0  # sequences preempted so far ("on_demand")

  @property
  def waiting(self) -> bool:
    """Whether any sequence waits for a slot or pages."""
    return bool(self.queue or self.extends or self.preempted)

  def first_waiting(self) -> HostSequence:
    """The sequence admitted next (`waiting` must be True)."""
    return (self.extends or self.preempted or self.queue[0])[0]

  def admitted(self, state: SeqState) -> list[HostSequence]:
    """The sequences in slots that are in `state`, by slot."""
    return [s for s in self.slots if s is not None and s.state is state]

  def pages_for(self, positions: int) -> int:
    """Pages that hold `positions` positions."""
    return -(-positions // self.config.page_size)

  def group_pages(self, cached: int, reserve: int, samples: int) -> int:
    """Pages a group needs: one sample's `reserve` positions, and each other sample's past the shared prompt pages."""
    own = self.pages_for(reserve)
    return own + (samples - 1) * (own - cached // self.config.page_size)

  def admit(self, call_tokens: int) -> None:
    """Starts queued extends, then preempted sequences, then queued groups, in order, while slots and pages are free.

    Args:
      call_tokens: positions the next call may write past a sequence's cached ones.
    """
    while self.extends:
      seq = self.extends[0]
      more = self.pages_for(seq.length + len(seq.feed) + seq.remaining) - len(seq.pages)
      if more > self.allocator.free_pages(seq.block):
        break
      seq.pages += self.allocator.allocate(seq.block, max(more, 0))
      seq.state = SeqState.PREFILL
      self.extends.popleft()
    # Room for every growing sequence's next call, kept free of new admissions: a sequence admitted into the last
    # free pages would be preempted (its prefill wasted) as soon as the older ones grow.
    spare = [0] * self.allocator.blocks
    for seq in self.slots:
      if seq is not None and self._grows(seq):
        spare[seq.block] += self.pages_for(call_tokens)
    while self.preempted and self._place([self.preempted[0]], call_tokens, spare):
      self.preempted.pop(0)
    while self.queue and self._place(self.queue[0], call_tokens, spare):
      self.queue.popleft()

  def make_room(self, call_tokens: int) -> None:
    """Gives every admitted sequence that grows the pages its next call may fill, preempting where a block runs out.

    Oldest first: a sequence that does not fit preempts the youngest growing
    sequence of its block (possibly itself) until it does, so the oldest
    always go on and every sequence finishes.

    Args:
      call_tokens: positions the next call may write past a sequence's cached ones.
    """
    growing = sorted((s for s in self.slots if s is not None and s.state in (SeqState.LIVE, SeqState.PREFILL)
                      and self._grows(s)), key=lambda s: s.seq_id)
    for seq in growing:
      if seq.state is SeqState.QUEUED:  # preempted by an older sequence of its block
        continue
      more = self.pages_for(seq.length + len(seq.feed) + min(call_tokens, seq.remaining)) - len(seq.pages)
      while more > self.allocator.free_pages(seq.block):
        victim = max((s for s in growing if s.block == seq.block and s.state is not SeqState.QUEUED),
                     key=lambda s: s.seq_id)
        self._preempt(victim)
        if victim is seq:
          break
      else:
        if more > 0:
          seq.pages += self.allocator.allocate(seq.block, more)

  def free(self, seq: HostSequence) -> None:
    """Gives back `seq`'s slot and pages."""
    self.allocator.release(seq.block, seq.pages)
    self._free_slots[seq.block].append(seq.slot)
    self.slots[seq.slot] = None
    seq.pages = []

  def _grows(self, seq: HostSequence) -> bool:
    """Whether `seq` takes its pages call by call ("on_demand" admission, not held for `extend`)."""
    return self.config.admission == "on_demand" and not seq.keep

  def _place(self, group: list[HostSequence], call_tokens: int, spare: list[int]) -> bool:
    """Gives `group` slots and pages in the emptiest block that holds them; False (nothing taken) when none does.

    The leader's pages cover its reserve ("reserve" admission, or held
    sequences) or its feed and first call ("on_demand", leaving `spare[b]`
    pages of block b free, to which the group adds its own next call); every
    other sample shares the leader's full prompt pages and takes its own
    beyond them.
    """
    leader = group[0]
    grows = self._grows(leader)
    if grows:
      positions = len(leader.feed) + min(call_tokens, leader.remaining)
    else:
      positions = max(leader.reserve, len(leader.feed) + leader.remaining)
    need = self.group_pages(len(leader.feed), positions, len(group))
    fits = [b for b in range(self.allocator.blocks) if len(self._free_slots[b]) >= len(group)
            and self.allocator.free_pages(b) >= need + (spare[b] if grows else 0)]
    if not fits:
      return False
    block = max(fits, key=self.allocator.free_pages)  # the emptiest block: keeps the devices balanced
    own = self.pages_for(positions)
    shared = len(leader.feed) // self.config.page_size
    for seq in group:
      seq.block, seq.slot = block, self._free_slots[block].pop()
      self.slots[seq.slot] = seq
    leader.pages = self.allocator.allocate(block, own)
    leader.state = SeqState.PREFILL
    for seq in group[1:]:
      self.allocator.share(block, leader.pages[:shared])
      seq.pages = leader.pages[:shared] + self.allocator.allocate(block, own - shared)
      seq.state, seq.feed = SeqState.FOLLOWER, []
    if grows:
      spare[block] += len(group) * self.pages_for(call_tokens)
    return True

  def _preempt(self, seq: HostSequence) -> None:
    """Frees `seq`'s slot and pages and queues its context to be prefilled again; its turn so far and RNG stay."""
    self.free(seq)
    seq.uncache()
    seq.block, seq.slot, seq.state = -1, -1, SeqState.QUEUED
    bisect.insort(self.preempted, seq, key=lambda s: s.seq_id)
    self.preemptions += 1
