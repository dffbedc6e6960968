"""Decides whether two final math answers are equivalent.

Both answers are normalised (LaTeX spacing and wrappers, `\\text{}` units,
degrees, dollar signs, thousands separators, a leading `x =`), then compared
by structure: intervals and tuples element by element with their brackets,
sets, unions and bare lists in any order, scalars through, in turn, exact text,
text answers ("(B)" == "b"), exact rational value (fractions, decimals, leading
zeros, percentages: "50%" equals both 50 and 0.5) and finally sympy symbolic
equality in a killable worker (`ptx.verifiers.sympy_check`). Decimals are exact: 0.333 is
not 1/3. Thread-safe.
"""

from __future__ import annotations

import fractions
import re

from ptx.verifiers import latex
from ptx.verifiers.sympy_check import SymbolicChecker, default_checker

# Multi-letter words only: a single letter after a number is more often a
# variable ("2m") than a unit.
_UNITS = ("units", "unit", "square", "sq", "cubic", "cm", "mm", "km", "meters", "meter", "metres", "kg",
          "grams", "mg", "lb", "lbs", "pounds", "oz", "ounces", "sec", "seconds", "second", "minutes", "minute",
          "min", "hours", "hour", "hrs", "days", "day", "weeks", "years", "dollars", "dollar", "cents", "degrees",
          "degree", "inches", "inch", "feet", "foot", "ft", "miles", "mile", "mph", "yards", "liters", "ml",
          "people", "students", "apples")
_UNIT_TAIL = re.compile(r"(?<=[\d})\s])\s*(?:(?:%s)\s*(?:\^\{?[23]\}?)?\s*)+\.?$" % "|".join(_UNITS))
_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}")
_DROP = (r"\left", r"\right", r"\displaystyle", r"\!", r"\,", r"\;", r"\:", r"\quad", r"\qquad", "\\ ",
         "^{\\circ}", "^\\circ", r"\circ", r"\degree", "°", r"\$", "$")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_LHS = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*")
_DECIMAL = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_FRAC = re.compile(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}")
_MIXED = re.compile(r"(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}")


def normalize(answer: str) -> str:
  """Returns the canonical text of one answer (no spaces; see the module docstring).

  Args:
    answer: an extracted final answer.

  Returns:
    Its normal form.
  """
  s = answer.strip().replace("−", "-").replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
  for wrap in (r"\(", r"\)", r"\[", r"\]"):
    s = s.replace(wrap, "")
  s = _WRAPPERS.sub(r" \1 ", s).replace("{,}", ",").replace(r"\%", "%")
  for token in _DROP:
    s = s.replace(token, " ")
  s = s.strip().rstrip(".").strip()
  s = _UNIT_TAIL.sub("", s).strip()
  if s.count("=") == 1:
    s = _LHS.sub("", s)
  s = re.sub(r"\s+", "", s)
  if _THOUSANDS.fullmatch(s):
    s = s.replace(",", "")
  return s


def _split_top(s: str, sep: str) -> list[str]:
  """Splits on `sep` outside brackets and braces."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(s):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == sep and depth == 0:
      parts.append(s[start:i])
      start = i + 1
  return parts + [s[start:]]


def _wrapped(s: str) -> bool:
  """Whether the first bracket closes only at the end: "(1,2)" yes, "(1,2),(3,4)" no."""
  depth = 0
  for i, ch in enumerate(s):
    depth += (ch in "([{") - (ch in ")]}")
    if depth == 0 and i < len(s) - 1:
      return False
  return depth == 0


def _structure(s: str) -> tuple[str, str, list[str]]:
  """Returns (kind, brackets, items): kind is "union", "set", "seq", "list" or "scalar"."""
  for cup in (r"\cup", "∪"):
    if cup in s:
      return "union", "", s.split(cup)
  if s.startswith(r"\{") and s.endswith(r"\}"):
    return "set", "", _split_top(s[2:-2], ",")
  if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _wrapped(s):
    inner = _split_top(s[1:-1], ",")
    if len(inner) > 1:
      return "seq", s[0] + s[-1], inner
  parts = _split_top(s, ",")
  return ("list", "", parts) if len(parts) > 1 else ("scalar", "", [s])


def _number(s: str) -> fractions.Fraction | None:
  """Returns the exact value of a plain number, fraction or mixed number, or None."""
  try:
    if _DECIMAL.fullmatch(s):
      return fractions.Fraction(s)
    if m := _MIXED.fullmatch(s):
      value = int(m[2]) + fractions.Fraction(int(m[3]), int(m[4]))
      return -value if m[1] else value
    if m := _FRAC.fullmatch(s):
      value = fractions.Fraction(m[2]) / fractions.Fraction(m[3])
      return -value if m[1] else value
    if re.fullmatch(r"-?\d+/\d+", s):
      return fractions.Fraction(s)
  except (ValueError, ZeroDivisionError):
    pass
  return None


def _readings(s: str) -> list[str]:
  """A percentage reads as its number and as that number over 100."""
  if s.endswith("%") and len(s) > 1:
    return [s[:-1], rf"\frac{{{s[:-1]}}}{{100}}"]
  return [s]


def _word(s: str) -> str | None:
  """Returns the lower-cased word of a text answer ("(B)" -> "b"), or None."""
  m = re.fullmatch(r"\(?([A-Za-z]+)\)?", s)
  return m[1].lower() if m else None


def _scalar_equal(a: str, b: str, checker: SymbolicChecker) -> bool:
  if a == b:
    return True
  word_a, word_b = _word(a), _word(b)
  if word_a is not None and word_b is not None:
    # A word or a multiple-choice letter: "(B)" == "b", "Yes" == "yes". Short
    # runs may still be products of symbols ("xy" == "yx").
    if word_a == word_b:
      return True
    if max(len(word_a), len(word_b)) > 3:
      return False
  for x in _readings(a):
    for y in _readings(b):
      nx, ny = _number(x), _number(y)
      if nx is not None and ny is not None:
        if nx == ny:
          return True
        continue
      sx, sy = latex.to_sympy(x), latex.to_sympy(y)
      if sx is not None and sy is not None and checker.equal(sx, sy):
        return True
  return False


def _unordered_equal(xs: list[str], ys: list[str], checker: SymbolicChecker) -> bool:
  if len(xs) != len(ys):
    return False
  left = list(ys)
  for x in xs:
    match = next((i for i, y in enumerate(left) if _equal(x, y, checker)), None)
    if match is None:
      return False
    left.pop(match)
  return True


def _equal(a: str, b: str, checker: SymbolicChecker) -> bool:
  if a == b:
    return True
  kind_a, brackets_a, items_a = _structure(a)
  kind_b, brackets_b, items_b = _structure(b)
  if kind_a == kind_b == "scalar":
    return _scalar_equal(a, b, checker)
  if kind_a == kind_b == "seq":
    return brackets_a == brackets_b and len(items_a) == len(items_b) and all(
        _equal(x, y, checker) for x, y in zip(items_a, items_b))
  if {kind_a, kind_b} <= {"set", "list"} or kind_a == kind_b == "union":
    return _unordered_equal(items_a, items_b, checker)
  return False


def equivalent(prediction: str, reference: str, *, checker: SymbolicChecker | None = None) -> bool:
  """Returns whether two final answers are mathematically the same.

  Args:
    prediction: the model's answer (already extracted).
    reference: the correct answer.
    checker: symbolic worker pool; by default the process-wide one.

  Returns:
    True when equivalent. A symbolic comparison that times out counts as False.
  """
  a, b = normalize(prediction), normalize(reference)
  if not a or not b:
    return False
  return _equal(a, b, checker or default_checker())
