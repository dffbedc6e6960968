"""plain_data: exact round trips of every plain type, refusal of anything else, bounded hostile decoding."""

import collections
import math
import random
import struct

import pytest

from ptx.verifiers.inside import plain_data


def _same(a, b) -> bool:
  """Equal with identical types all the way down (nan equals nan)."""
  if type(a) is not type(b):
    return False
  if type(a) is float:
    return a == b or (math.isnan(a) and math.isnan(b))
  if type(a) is complex:
    return _same(a.real, b.real) and _same(a.imag, b.imag)
  if type(a) in (list, tuple):
    return len(a) == len(b) and all(map(_same, a, b))
  if type(a) is dict:
    return list(map(type, a)) == list(map(type, b)) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  return a == b


VALUES = [
    None, True, False, 0, 1, -1, 255, -256, 2**63, -(2**100), 10**4000,
    0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 1e-310, complex(1, -2), complex(math.nan, math.inf),
    "", "héllo ✓", "\ud800 lone surrogate", "\x00", b"", b"\x00\xff", [], (), {}, set(), frozenset(),
    [1, (2, [3.0])], (None, True), {"a": 1, 1: "a", (1, "x"): [b"y"], None: {}, 2.5: frozenset({1})},
    {1, "1", (1,), b"1"}, frozenset({frozenset({True})}), [[[[[[[]]]]]]],
]


# Ids by position: the repr of a set depends on string hashing, which differs between xdist workers.
@pytest.mark.parametrize("value", VALUES, ids=[f"value{i}" for i in range(len(VALUES))])
def test_round_trip_keeps_exact_types(value):
  assert _same(plain_data.decode(plain_data.encode(value)), value)


def test_bool_int_and_float_stay_apart():
  assert type(plain_data.decode(plain_data.encode(True))) is bool
  assert type(plain_data.decode(plain_data.encode(1))) is int
  assert type(plain_data.decode(plain_data.encode(1.0))) is float
  assert type(plain_data.decode(plain_data.encode((1,)))) is tuple
  assert math.copysign(1, plain_data.decode(plain_data.encode(-0.0))) == -1


class Int(int):
  def __eq__(self, other):
    return True


class Liar:
  def __eq__(self, other):
    return True

  __hash__ = object.__hash__


@pytest.mark.parametrize("value", [
    Int(3), type("Str", (str,), {})("x"), type("List", (list,), {})([1]), collections.OrderedDict(),
    Liar(), [1, Liar()], {"k": Liar()}, {Liar()}, bytearray(b"x"), memoryview(b"x"), range(3), len,
    (x for x in ()), object, math,
], ids=lambda v: type(v).__name__)
def test_encode_refuses_what_is_not_plain(value):
  with pytest.raises(plain_data.NotPlainData):
    plain_data.encode(value)


def test_handle_hook_stands_for_non_plain_values_but_not_keys_or_elements():
  liar = Liar()
  data = plain_data.encode([1, liar, {"k": liar}], handle=lambda x: ("obj", id(x)))
  assert plain_data.decode(data, handle=lambda p: p) == [1, ("obj", id(liar)), {"k": ("obj", id(liar))}]
  with pytest.raises(plain_data.DecodeError, match="handle"):
    plain_data.decode(data)  # without a hook, a handle is refused
  for value in ({liar: 1}, {liar}, frozenset([liar])):
    with pytest.raises(plain_data.NotPlainData):
      plain_data.encode(value, handle=lambda x: 0)


def test_encode_bounds():
  with pytest.raises(plain_data.TooLarge, match="bits"):
    plain_data.encode(1 << (plain_data.MAX_INT_BITS + 1))
  nested = []
  for _ in range(plain_data.MAX_DEPTH + 1):
    nested = [nested]
  with pytest.raises(plain_data.TooLarge, match="deeper"):
    plain_data.encode(nested)
  loop = []
  loop.append(loop)
  with pytest.raises(plain_data.TooLarge, match="deeper"):
    plain_data.encode(loop)
  with pytest.raises(plain_data.TooLarge, match="bytes"):
    plain_data.encode("x" * (plain_data.MAX_MESSAGE_BYTES + 1))


def _u32(n: int) -> bytes:
  return struct.pack(">I", n)


@pytest.mark.parametrize("data,match", [
    (b"", "truncated"),
    (b"?", "unknown tag"),
    (b"NN", "after the value"),
    (b"i" + _u32(4) + b"\x00", "truncated"),
    (b"i" + _u32(plain_data.MAX_INT_BITS // 8 + 2) + b"\x01" * 2000, "int of"),
    (b"f\x00\x00", "truncated"),
    (b"s" + _u32(2) + b"\xff\xfe", "UTF-8"),
    (b"s" + _u32(1 << 31), "truncated"),
    (b"l" + _u32(1 << 31), "count"),
    (b"d" + _u32(1) + b"l" + _u32(0) + b"N", "unhashable"),
    (b"S" + _u32(2) + b"T" + b"i" + _u32(1) + b"\x01", "equal keys"),
    (b"d" + _u32(2) + b"TN" + b"i" + _u32(1) + b"\x01N", "equal keys"),
    ((b"l" + _u32(1)) * 5000 + b"N", "deeper"),
    (b"h" + b"N", "handle"),
    (b"x" * (plain_data.MAX_MESSAGE_BYTES + 1), "at most"),
])
def test_decode_refuses_hostile_input(data, match):
  with pytest.raises(plain_data.DecodeError, match=match):
    plain_data.decode(data)


def test_decode_bounds_handles_and_depth_with_a_hook():
  deep = b"l" + _u32(1)
  with pytest.raises(plain_data.DecodeError, match="deeper"):
    plain_data.decode(deep * (plain_data.MAX_DEPTH + 1) + b"N", handle=lambda p: p)
  with pytest.raises(plain_data.DecodeError, match="handle"):
    # A handle as a set element could not be hashed: refused even with a hook.
    plain_data.decode(b"S" + _u32(1) + b"hN", handle=lambda p: p)


def test_largest_int_round_trips():
  big = (1 << plain_data.MAX_INT_BITS) - 1
  assert plain_data.decode(plain_data.encode(-big)) == -big
  str(big)  # within Python's int-to-str limit, so a failure message can show it


def test_decode_of_mangled_messages_raises_only_decode_error():
  rng = random.Random(0)  # fixed: the same mangled messages every run
  for value in VALUES:
    data = plain_data.encode(value)
    for _ in range(50):
      mangled = bytearray(data)
      for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(mangled) + 1)
        choice = rng.random()
        if choice < 0.5 and at < len(mangled):
          mangled[at] = rng.randrange(256)
        elif choice < 0.75:
          del mangled[at:]
        else:
          mangled.insert(at, rng.randrange(256))
      try:
        plain_data.decode(bytes(mangled))
      except plain_data.DecodeError:
        pass


@pytest.mark.parametrize("a,b", [
    (1, 1), (1.5, 1.5), (math.nan, float("nan")), (0.0, -0.0), (complex(1, math.nan), complex(1, math.nan)),
    ("x", "x"), (b"x", b"x"), (None, None), ([1, (2, "x")], [1, (2, "x")]),
    ({1: "a", "b": [2.0]}, {"b": [2.0], 1: "a"}),
    ({1, 2}, {2, 1}), (frozenset({(1, 2.0)}), frozenset({(1, 2.0)})), ({math.nan: 1}, {float("nan"): 1}),
])
def test_same(a, b):
  assert plain_data.same(a, b) and plain_data.same(b, a)


@pytest.mark.parametrize("a,b", [
    (True, 1), (1, 1.0), (0, False), (1.0, complex(1, 0)), ((1,), [1]), ("x", b"x"), (None, 0), ([1], [1, 1]),
    ({1: "a"}, {True: "a"}), ({1: "a"}, {1.0: "a"}), ({1: 2}, {1: 2.0}), ({1}, {1.0}), ({1}, frozenset({1})),
    ({(1, math.nan), (1, float("nan"))}, {(1, math.nan), (True, 2)}), ([[True]], [[1]]),
])
def test_not_same(a, b):
  assert not plain_data.same(a, b) and not plain_data.same(b, a)


def test_contains():
  assert plain_data.contains(1, [1.0, 1]) and not plain_data.contains(True, [1, 1.0])
  assert plain_data.contains("a", {"a": 1}) and not plain_data.contains(True, {1: "one"})
  assert plain_data.contains(math.nan, {1, float("nan")}) and not plain_data.contains((1,), {(True,)})
  assert not plain_data.contains([1], {1}) and plain_data.contains("b", "abc")
