"""Where the Tunix harness is: the peer's side of a side-by-side run.

The harness (`tunix_bench.py`, the anchor configs run by Tunix itself) does
not ship with ptx; point `TUNIX_BENCH` at it.
"""

import os
import pathlib


def path() -> pathlib.Path:
  """The Tunix harness named by `TUNIX_BENCH`, or an error saying how to give it."""
  path = os.environ.get("TUNIX_BENCH")
  if not path or not pathlib.Path(path).is_file():
    raise SystemExit(f"TUNIX_BENCH={path!r}: set it to the Tunix harness tunix_bench.py (not shipped with ptx) "
                     "to run the Tunix side")
  return pathlib.Path(path)
