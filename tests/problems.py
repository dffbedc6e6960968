"""The problem a built-in task's record poses, for tests that count problems shared between streams."""

import re

from ptx.data.arithmetic import identity

_ARITHMETIC = re.compile(r"(\d+)([-+*])(\d+)=")


def arithmetic(prompt: str) -> str:
  """The identity of arithmetic prompt "a op b=" (3+5= and 5+3= are one problem)."""
  a, op, b = _ARITHMETIC.fullmatch(prompt).groups()
  return identity(int(a), op, int(b))
