"""The symbolic checker's worker process: compares two expressions with sympy.

Run as `python -I sympy_worker.py MEMORY_BYTES`, never imported. It reads one
JSON pair `[a, b]` per line on stdin and answers one JSON line on stdout: true,
false, or null when an expression does not parse. The parent kills it when an
answer is late (`ptx.verifiers.sympy_check`), so nothing here needs a timeout; the
address-space limit keeps a runaway simplification from taking the host's
memory. Inputs were checked by `ptx.verifiers.latex`: only numbers, operators,
parentheses, single-letter symbols and a fixed list of functions reach
`parse_expr`, which evaluates its input.
"""

import json
import resource
import sys

import sympy
from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application, parse_expr,
                                        rationalize, standard_transformations)

# Floats become exact rationals, so 0.333 never equals 1/3; "2x" means 2*x.
_TRANSFORMS = standard_transformations + (convert_xor, implicit_multiplication_application, rationalize)
_TOLERANCE = 1e-12  # relative; only for values sympy cannot prove equal exactly


def _equal(a_text, b_text):
  """Returns whether a == b, or None when either does not parse."""
  try:
    a = parse_expr(a_text, transformations=_TRANSFORMS, evaluate=True)
    b = parse_expr(b_text, transformations=_TRANSFORMS, evaluate=True)
  except Exception:  # noqa: BLE001  (sympy raises many kinds on bad input)
    return None
  if a == b:
    return True
  try:
    diff = sympy.simplify(a - b)
    if diff == 0:
      return True
    if diff.free_symbols:
      return False
    size = max(1.0, abs(complex(sympy.N(a, 30))))
    return abs(complex(sympy.N(diff, 30))) <= _TOLERANCE * size
  except Exception:  # noqa: BLE001
    return False


def main():
  limit = int(sys.argv[1])
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  for line in sys.stdin:
    a, b = json.loads(line)
    sys.stdout.write(json.dumps(_equal(a, b)) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
