"""JAX's persistent compilation cache for ptx's commands: a second launch of a job skips XLA compilation.

`ptx sft`, `dpo`, `grpo`, `demo` and `eval` call `enable()` before they
compile anything. Most of a short job's wall time is compilation (the
train step, the state initialiser, one sampler program per shape bucket);
with the cache, `ptx grpo --train.steps=3` on the 2-core CPU machine takes
22.5 s cold and 10.8 s warm. Entries are keyed by the program, its compile
options and flags, the backend and the jax version, so an entry is only
reused for an identical compilation.

Where it lives, first match wins:
  PTX_COMPILATION_CACHE=off   no cache
  PTX_COMPILATION_CACHE=DIR   DIR (a local path, or any path JAX's cache accepts)
  a directory already given to JAX (JAX_COMPILATION_CACHE_DIR, or
  jax.config.update("jax_compilation_cache_dir", ...)) is kept as it is
  otherwise $XDG_CACHE_HOME/ptx/jax, by default ~/.cache/ptx/jax

Only compilations that take at least `jax_persistent_cache_min_compile_time_secs`
(JAX's default, 1 s) are written. The directory is never pruned by ptx.
"""

from __future__ import annotations

import os
import pathlib

import jax

ENV = "PTX_COMPILATION_CACHE"
_OFF = ("off", "0", "none", "false")


def enable() -> str | None:
  """Turns JAX's persistent compilation cache on for this process, unless it is off; call before compiling.

  Returns:
    The cache directory in use, or None when `PTX_COMPILATION_CACHE` turns
    the cache off.
  """
  setting = os.environ.get(ENV, "").strip()
  if setting.lower() in _OFF:
    return None
  if not setting and jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  if setting:
    directory = setting if "://" in setting else str(pathlib.Path(setting).expanduser())
  else:
    directory = str(pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "ptx" / "jax")
  jax.config.update("jax_compilation_cache_dir", directory)
  return directory
