"""The process's memory maps against Linux's per-process limit, which compiled XLA:CPU programs can exhaust.

Each loaded XLA:CPU executable maps three small regions (code, constants,
data) per kernel: over a thousand for one engine program of a 30-layer
model, whose decode unrolls its layers. Linux refuses a process more than
`vm.max_map_count` maps (65,530 by default), and LLVM aborts the process
when it cannot map a program it compiled. `crowded` tells a holder of
compiled programs (`ptx.sampling.engine.programs.Programs`) when to drop
its own before the next compilation can cross the limit.
"""

from __future__ import annotations

import pathlib

# Linux's limit of memory maps per process, and this process's maps (one line each).
LIMIT_FILE = pathlib.Path("/proc/sys/vm/max_map_count")
MAPS_FILE = pathlib.Path("/proc/self/maps")
# The share of the limit kept free for what comes next: a program of a 30-layer model maps 1,000-2,500 regions,
# and a quarter of the default limit leaves room for several before LLVM would abort.
HEADROOM = 0.25


def limit() -> int | None:
  """The per-process limit of memory maps (`vm.max_map_count`), or None where the system has none to read."""
  try:
    return int(LIMIT_FILE.read_text())
  except (OSError, ValueError):
    return None


def held() -> int:
  """Memory maps this process holds now (0 where the system does not list them)."""
  try:
    with MAPS_FILE.open("rb") as maps:
      return sum(1 for _ in maps)
  except OSError:
    return 0


def crowded(headroom: float = HEADROOM) -> bool:
  """Whether this process holds more maps than leave `headroom` (a share) of its limit free; False without one."""
  most = limit()
  return most is not None and held() > most * (1 - headroom)
