"""Checksums that a checkpoint carries, so that a damaged one is detected before anything trains on it.

`array_checksums(tree)` fingerprints every array of a (sharded) pytree on
the device: each element's bits, read as 32-bit words, are multiplied by an
odd weight that depends on the element's position and summed modulo 2**32,
twice with different weights. Integer sums modulo 2**32 do not depend on
the order of the reduction, so the fingerprint is the same for any mesh,
sharding or thread count the state is later restored on, and any change of
one element changes it (an odd weight is invertible modulo 2**32). Nothing
crosses to the host but two words per array.

`host_checksum(obj)` is a SHA-256 of host data (the data iterator's JSON
state, the pipeline's numpy arrays). `gathered(local)` gives every process
the checksums of all of them, for values each process holds its own of.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

# Golden-ratio and murmur constants: position weights that look unrelated from one element to the next.
_WEIGHTS = (0x9E3779B1, 0x85EBCA77)


def array_checksums(tree: Any) -> dict[str, str]:
  """{leaf path: 16 hex digits} for every array leaf of `tree` (None leaves are left out)."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  if not leaves:
    return {}
  paths = [jax.tree_util.keystr(path) for path, _ in leaves]
  words = jax.device_get(_fingerprints([leaf for _, leaf in leaves]))
  return {path: f"{int(a):08x}{int(b):08x}" for path, (a, b) in zip(paths, words)}


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> list[tuple[jax.Array, jax.Array]]:
  return [_fingerprint(_words(x)) for x in leaves]


def _words(x: jax.Array) -> jax.Array:
  """The bits of `x` as uint32, one word per element (two for 8-byte types)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size in (4, 8):  # 8-byte types get a trailing axis of 2 words
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 1: jnp.uint8}[size]).astype(jnp.uint32)


def _fingerprint(words: jax.Array) -> tuple[jax.Array, jax.Array]:
  position = jax.lax.iota(jnp.uint32, words.size).reshape(words.shape)
  sums = []
  for weight in _WEIGHTS:
    odd = position * jnp.uint32(weight) * jnp.uint32(2) + jnp.uint32(1)  # wraps modulo 2**32
    sums.append(jnp.sum(words * odd, dtype=jnp.uint32))
  return sums[0], sums[1]


def host_checksum(obj: Any) -> str:
  """SHA-256 (hex) of JSON-like data whose leaves may be numpy arrays (dtype, shape and bytes count)."""
  digest = hashlib.sha256()

  def visit(x: Any) -> None:
    if isinstance(x, dict):
      for key in sorted(x):
        digest.update(json.dumps(str(key)).encode())
        visit(x[key])
    elif isinstance(x, (list, tuple)):
      digest.update(f"[{len(x)}".encode())
      for item in x:
        visit(item)
    elif isinstance(x, (np.ndarray, np.generic, jax.Array)):
      array = np.asarray(x)
      digest.update(f"{array.dtype.str}{array.shape}".encode())
      digest.update(np.ascontiguousarray(array).tobytes())
    else:
      digest.update(json.dumps(x, sort_keys=True, default=repr).encode())

  visit(obj)
  return digest.hexdigest()


def gathered(local: str) -> list[str]:
  """Every process's value of `local` (a hex checksum), in process order."""
  if jax.process_count() == 1:
    return [local]
  words = np.frombuffer(bytes.fromhex(local), np.uint32)
  every = np.asarray(multihost_utils.process_allgather(words))
  return [row.astype(np.uint32).tobytes().hex() for row in every.reshape(jax.process_count(), -1)]
