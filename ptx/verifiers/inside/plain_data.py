"""Plain data: the only values that cross between a solution's process and its grader.

Plain data is None, bool, int, float (nan and inf included), complex, str,
bytes, and list, tuple, dict, set and frozenset of plain data, nested. Types
are exact on both sides: `encode` checks `type(x) is int`, never isinstance,
so an int subclass, or any object with methods of its own (an `__eq__` that
always says yes), is not plain data; `decode` builds only those types, so no
code of the sender's runs where a message is read. A `handle` hook may stand
for other values (the solution's objects, by number): `encode` passes it each
non-plain value (never a dict key or set element, which must be hashable
plain data) and sends the plain payload it returns; `decode` passes it each
payload back.

`same` and `contains` are `==` and `in` with exact types, for comparing
what crossed: True != 1, 1 != 1.0, (1,) != [1].

`decode` takes hostile input: the message size, the nesting depth and the
size of ints are bounded, and anything malformed raises `DecodeError`. No
eval, no pickle. Standard library only: the sandboxed scripts import it by
its file name.

The format: one tag byte per value, big-endian lengths and counts of 4 bytes:
N T F (None, True, False); i (length, two's complement bytes); f (8-byte
double); c (two doubles); s (length, UTF-8 with surrogates passed); b (length,
bytes); l t S z (list, tuple, set, frozenset: count, items); d (count, key
value pairs); h (a handle: its payload).
"""

import struct

MAX_MESSAGE_BYTES = 4 << 20
MAX_DEPTH = 100  # containers (and handles) inside one another
# About 4,200 decimal digits: under Python's 4,300-digit limit on int-to-str,
# so any int that crosses can also be printed in a failure message.
MAX_INT_BITS = 14_000

_U32 = struct.Struct(">I")
_F64 = struct.Struct(">d")
_C128 = struct.Struct(">dd")
_SEQUENCES = {list: b"l", tuple: b"t", set: b"S", frozenset: b"z"}
_BUILD = {b"l"[0]: list, b"t"[0]: tuple, b"S"[0]: set, b"z"[0]: frozenset}
_HASHED = (set, frozenset)


class NotPlainData(TypeError):
  """`encode` met a value that is not plain data (and no handle hook took it)."""


class TooLarge(ValueError):
  """`encode` met plain data past a bound (message size, depth, int size)."""


class DecodeError(ValueError):
  """A message is malformed or past a bound."""


def encode(value, handle=None) -> bytes:
  """Encodes plain data (and, with `handle`, values it stands for).

  Args:
    value: the value.
    handle: called with each non-plain value outside dict keys and set
      elements; returns its plain payload or raises NotPlainData.

  Returns:
    The message, at most MAX_MESSAGE_BYTES.
  """
  out = bytearray()
  _encode(value, out, handle, 0)
  if len(out) > MAX_MESSAGE_BYTES:
    raise TooLarge(f"the message takes over {MAX_MESSAGE_BYTES} bytes")
  return bytes(out)


def _encode(x, out: bytearray, handle, depth: int) -> None:
  t = type(x)
  if x is None:
    out += b"N"
  elif t is bool:
    out += b"T" if x else b"F"
  elif t is int:
    if x.bit_length() > MAX_INT_BITS:
      raise TooLarge(f"an int of {x.bit_length()} bits (at most {MAX_INT_BITS})")
    n = x.bit_length() // 8 + 1  # room for the sign bit
    out += b"i" + _U32.pack(n) + x.to_bytes(n, "big", signed=True)
  elif t is float:
    out += b"f" + _F64.pack(x)
  elif t is complex:
    out += b"c" + _C128.pack(x.real, x.imag)
  elif t is str or t is bytes:
    data = x.encode("utf-8", "surrogatepass") if t is str else x
    _check_room(out, len(data))
    out += (b"s" if t is str else b"b") + _U32.pack(len(data)) + data
  elif t in _SEQUENCES or t is dict:
    if depth >= MAX_DEPTH:
      raise TooLarge(f"nested deeper than {MAX_DEPTH}")
    _check_room(out, len(x))
    out += (b"d" if t is dict else _SEQUENCES[t]) + _U32.pack(len(x))
    if t is dict:
      for key, item in x.items():
        _encode(key, out, None, depth + 1)
        _encode(item, out, handle, depth + 1)
    else:
      inner = None if t in _HASHED else handle
      for item in x:
        _encode(item, out, inner, depth + 1)
  elif handle is not None:
    if depth >= MAX_DEPTH:
      raise TooLarge(f"nested deeper than {MAX_DEPTH}")
    out += b"h"
    _encode(handle(x), out, None, depth + 1)
  else:
    raise NotPlainData(f"a {t.__name__} is not plain data")


def _check_room(out: bytearray, more: int) -> None:
  # Checked as it grows, so a huge value fails before it is all copied.
  if len(out) + more > MAX_MESSAGE_BYTES:
    raise TooLarge(f"the message takes over {MAX_MESSAGE_BYTES} bytes")


def decode(data: bytes, handle=None):
  """Decodes one message.

  Args:
    data: the message.
    handle: called with each handle's payload; returns what stands in for
      it. Without it a handle is a DecodeError.

  Returns:
    The value.

  Raises:
    DecodeError: malformed, trailing bytes, or past a bound.
  """
  if len(data) > MAX_MESSAGE_BYTES:
    raise DecodeError(f"a message of {len(data)} bytes (at most {MAX_MESSAGE_BYTES})")
  data = bytes(data)
  value, end = _decode(data, 0, handle, 0)
  if end != len(data):
    raise DecodeError(f"{len(data) - end} bytes after the value")
  return value


def _take(data: bytes, pos: int, n: int) -> int:
  """Returns where `n` bytes from `pos` end, checking they are there."""
  if len(data) - pos < n:
    raise DecodeError(f"truncated: needs {n} bytes at offset {pos}, has {len(data) - pos}")
  return pos + n


def _length(data: bytes, pos: int) -> tuple[int, int]:
  end = _take(data, pos, 4)
  return _U32.unpack_from(data, pos)[0], end


def _decode(data: bytes, pos: int, handle, depth: int):
  tag = data[_take(data, pos, 1) - 1]
  pos += 1
  if tag in b"NTF":
    return (None, True, False)[b"NTF".index(tag)], pos
  if tag == b"i"[0]:
    n, pos = _length(data, pos)
    if n > MAX_INT_BITS // 8 + 1:
      raise DecodeError(f"an int of {n} bytes (at most {MAX_INT_BITS} bits)")
    end = _take(data, pos, n)
    value = int.from_bytes(data[pos:end], "big", signed=True)
    if value.bit_length() > MAX_INT_BITS:
      raise DecodeError(f"an int of {value.bit_length()} bits (at most {MAX_INT_BITS})")
    return value, end
  if tag == b"f"[0]:
    end = _take(data, pos, 8)
    return _F64.unpack_from(data, pos)[0], end
  if tag == b"c"[0]:
    end = _take(data, pos, 16)
    return complex(*_C128.unpack_from(data, pos)), end
  if tag in b"sb":
    n, pos = _length(data, pos)
    end = _take(data, pos, n)
    if tag == b"b"[0]:
      return data[pos:end], end
    try:
      return data[pos:end].decode("utf-8", "surrogatepass"), end
    except UnicodeDecodeError as e:
      raise DecodeError(f"a str that is not UTF-8: {e}") from None
  if tag in b"ltSzdh" and depth >= MAX_DEPTH:
    raise DecodeError(f"nested deeper than {MAX_DEPTH}")
  if tag == b"h"[0]:
    if handle is None:
      raise DecodeError("a handle where only plain data may be")
    payload, pos = _decode(data, pos, None, depth + 1)
    return handle(payload), pos
  if tag in b"ltSzd":
    return _container(data, pos, tag, handle, depth)
  raise DecodeError(f"unknown tag {tag!r} at offset {pos - 1}")


def _container(data: bytes, pos: int, tag: int, handle, depth: int):
  count, pos = _length(data, pos)
  # Every item takes at least one byte: a count past that is a lie, refused
  # before anything is allocated for it.
  if count > len(data) - pos:
    raise DecodeError(f"a count of {count} with {len(data) - pos} bytes left")
  kind = dict if tag == b"d"[0] else _BUILD[tag]
  inner = None if kind in _HASHED else handle
  items = []
  for _ in range(count * 2 if kind is dict else count):
    # Dict keys (even positions) are hashed: plain data only.
    item, pos = _decode(data, pos, None if kind is dict and not len(items) % 2 else inner, depth + 1)
    items.append(item)
  try:
    value = dict(zip(items[::2], items[1::2], strict=True)) if kind is dict else kind(items)
  except TypeError as e:  # a list as a dict key or set element
    raise DecodeError(f"an unhashable {kind.__name__} key or element: {e}") from None
  if len(value) != count:
    raise DecodeError(f"a {kind.__name__} with equal keys or elements")
  return value, pos


def same(a, b) -> bool:
  """`a == b` with identical types all the way down: True != 1, 1 != 1.0, (1,) != [1].

  nan equals nan (an expected nan could never be met otherwise), and 0.0
  equals -0.0 as in Python. Values that are not plain data compare as Python
  compares them.

  Args:
    a: a value.
    b: another.

  Returns:
    Whether they are the same plain data.
  """
  t = type(a)
  if t is not type(b):
    return False
  if t is float:
    return a == b or (a != a and b != b)
  if t is complex:
    return same(a.real, b.real) and same(a.imag, b.imag)
  if t is list or t is tuple:
    return len(a) == len(b) and all(map(same, a, b))
  if t is dict:
    if len(a) != len(b) or not _covers(b, a):
      return False
    index = _index(b)
    return all((k := _match(b, index, key)) is not _MISSING and same(v, b[k]) for key, v in a.items())
  if t is set or t is frozenset:
    return len(a) == len(b) and _covers(a, b) and _covers(b, a)
  return bool(a == b)


def contains(x, container) -> bool:
  """`x in container`, with `same` for lists, tuples, sets and dicts (their keys).

  Args:
    x: the value looked for.
    container: where.

  Returns:
    Whether some element is the same plain data as `x`.
  """
  t = type(container)
  if t is list or t is tuple:
    return any(same(x, y) for y in container)
  if t in (set, frozenset, dict):
    try:
      hit = x in container
    except TypeError:  # x is unhashable: no element can be equal to it
      return False
    if not hit:
      return _has_nan(x) and any(same(x, y) for y in container)
    if type(x) is str or type(x) is bytes:
      return True  # only a str equals a str (plain data has no subclasses)
    return _match(container, _index(container), x) is not _MISSING
  return x in container


_MISSING = object()


def _index(container) -> dict:
  """Each element (key) of a set or dict by itself: a lookup finds the stored one, not just an equal one."""
  return {y: y for y in container}


def _has_nan(x) -> bool:
  t = type(x)
  if t is float or t is complex:
    return x != x
  if t in (list, tuple, set, frozenset):
    return any(map(_has_nan, x))
  return t is dict and (_has_nan(tuple(x)) or _has_nan(tuple(x.values())))


def _match(container, index: dict, x):
  """The element (key) of `container` strictly equal to `x`, else _MISSING."""
  try:
    found = index.get(x, _MISSING)
  except TypeError:  # x is unhashable: no element can be equal to it
    return _MISSING
  if found is not _MISSING and same(x, found):
    return found
  # A lookup finds True for 1 (then no 1 can be there), but one nan never
  # finds another: only then look at every element.
  if not _has_nan(x):
    return _MISSING
  return next((y for y in container if same(x, y)), _MISSING)


def _covers(a, b) -> bool:
  """Every element (key) of `a` has a strictly equal one in `b`."""
  index = _index(b)
  return all(_match(b, index, x) is not _MISSING for x in a)
