"""Turns a LaTeX math answer into safe sympy expression text, or refuses.

`sympy.parse_expr` evaluates its input, so only a closed vocabulary may reach
it: digits, `+ - * / ( ) .`, spaces, single-letter symbols (runs of up to
three letters like `xy` become products), and the names in `_NAMES`. Anything else (an unknown
LaTeX command, `__import__`, a string) makes `to_sympy` return None.
"""

from __future__ import annotations

import re

_COMMANDS = {
    r"\cdot": "*", r"\times": "*", r"\div": "/", r"\pi": " pi ", r"\infty": " oo ", r"\infin": " oo ",
    r"\ln": " log ", r"\log": " log ", r"\exp": " exp ", r"\sin": " sin ", r"\cos": " cos ", r"\tan": " tan ",
    r"\sec": " sec ", r"\csc": " csc ", r"\cot": " cot ", r"\arcsin": " asin ", r"\arccos": " acos ",
    r"\arctan": " atan ",
}
_NAMES = {"sqrt", "pi", "oo", "E", "I", "log", "exp", "sin", "cos", "tan", "sec", "csc", "cot", "asin",
          "acos", "atan"}
_SAFE = re.compile(r"[0-9A-Za-z+\-*/(). ]*")
_MAX_LEN = 300  # longer answers are not compared symbolically


def _group(text: str, i: int) -> tuple[str, int]:
  """Returns the argument starting at `i` ({...} or one character) and the index after it."""
  while i < len(text) and text[i] == " ":
    i += 1
  if i >= len(text):
    raise ValueError("missing argument")
  if text[i] != "{":
    return text[i], i + 1
  depth = 0
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i + 1:j], j + 1
  raise ValueError("unbalanced braces")


def _expand(text: str) -> str:
  """Rewrites \\frac and \\sqrt (recursively) into parenthesised sympy syntax."""
  out, i = [], 0
  while i < len(text):
    if text.startswith(r"\frac", i):
      num, i = _group(text, i + 5)
      den, i = _group(text, i)
      out.append(f"(({_expand(num)})/({_expand(den)}))")
    elif text.startswith(r"\sqrt", i):
      i += 5
      root = None
      if text[i:i + 1] == "[":
        end = text.index("]", i)
        root, i = text[i + 1:end], end + 1
      arg, i = _group(text, i)
      out.append(f"sqrt({_expand(arg)})" if root is None else f"(({_expand(arg)})**(1/({_expand(root)})))")
    else:
      out.append(text[i])
      i += 1
  return "".join(out)


def to_sympy(latex: str) -> str | None:
  """Returns sympy expression text for `latex`, or None when it is not a plain expression.

  Args:
    latex: one normalised scalar answer, e.g. "2\\sqrt{2}" or "\\frac{x+1}{2}".

  Returns:
    Text for `sympy.parse_expr` that uses only the safe vocabulary, or None.
  """
  if len(latex) > _MAX_LEN:
    return None
  try:
    text = _expand(latex.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac"))
  except ValueError:
    return None
  for command in sorted(_COMMANDS, key=len, reverse=True):
    text = text.replace(command, _COMMANDS[command])
  text = text.replace("^", "**").replace("{", "(").replace("}", ")")
  # Euler's number and the imaginary unit, when they stand alone.
  text = re.sub(r"(?<![A-Za-z])e(?![A-Za-z])", "E", text)
  text = re.sub(r"(?<![A-Za-z])i(?![A-Za-z])", "I", text)
  if not _SAFE.fullmatch(text) or not text.strip():
    return None
  names = set(re.findall(r"[A-Za-z]+", text)) - _NAMES
  if any(len(name) > 3 for name in names):
    return None
  # A short run of letters is a product of symbols ("xy"), never a builtin ("abs").
  text = re.sub(r"[A-Za-z]+", lambda m: m[0] if m[0] in _NAMES else "*".join(m[0]), text)
  return text if text.count("(") == text.count(")") else None
