"""ptx.verifiers.math_equal, math_answer, latex_expr and symbolic: a table of answer pairs."""

import threading

import pytest

from ptx.verifiers import latex, math_answer, math_equal, sympy_check

# (prediction, reference, equivalent)
PAIRS = [
    # fractions
    ("1/2", "0.5", True), (r"\frac{1}{2}", "1/2", True), (r"\dfrac{1}{2}", "0.5", True), (r"\tfrac12", ".5", True),
    (r"\frac{2}{4}", r"\frac{1}{2}", True), (r"-\frac{3}{4}", "-0.75", True), (r"\frac{-3}{4}", "-3/4", True),
    (r"2\frac{1}{2}", "5/2", True), (r"\frac{1}{3}", "0.333", False), (r"\frac{1}{2}", r"\frac{1}{3}", False),
    ("3/4", "4/3", False), (r"\frac{10}{4}", "2.5", True),
    # decimals
    ("0.50", "0.5", True), (".5", "0.5", True), ("2.0", "2", True), ("2.000", "2", True), ("3.14", r"\pi", False),
    ("0.1", "0.10000", True), ("1.5", "1.05", False), ("-0.0", "0", True), ("1e3", "1000", True),
    ("2.5", "5/2", True), ("0.3333333", "1/3", False),
    # LaTeX
    (r"\sqrt{8}", r"2\sqrt{2}", True), (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
    (r"2\pi", r"\pi \cdot 2", True), (r"\left(\frac{1}{2}\right)", "0.5", True), (r"x^2-1", "(x-1)(x+1)", True),
    (r"x^{2}+2x+1", r"(x+1)^2", True), (r"\sqrt[3]{27}", "3", True), (r"3 \times 10^{4}", "30000", True),
    (r"e^{i\pi}", "-1", True), (r"3+4i", "4i+3", True), (r"\displaystyle \frac{3}{5}", "0.6", True),
    (r"\sqrt{2}", "1.41421356", False), (r"2\sqrt{3}", r"3\sqrt{2}", False), (r"x^2", "2x", False),
    (r"\frac{x+1}{2}", r"\frac{x}{2}+\frac{1}{2}", True), (r"\ln(e^2)", "2", True), (r"\pi r^2", r"r^2\pi", True),
    (r"\boxed{5}", "5", False), (r"\alpha", r"\alpha", True), (r"\beta", r"\alpha", False),
    # percentages
    ("50%", "50", True), (r"50\%", "0.5", True), ("50%", r"\frac{1}{2}", True), ("12.5%", "0.125", True),
    (r"25\%", "25", True), ("50%", "5", False), ("50%", "0.05", False), ("100%", "1", True),
    # units
    ("5 cm", "5", True), (r"5\text{ cm}", "5", True), (r"12\text{ meters}", "12", True), ("3 hours", "3", True),
    (r"\$5", "5", True), (r"\$5.00", "5", True), ("5 dollars", "5", True), (r"90^\circ", "90", True),
    (r"90^{\circ}", "90", True), ("90°", "90", True), (r"6\text{ cm}^2", "6", True), ("5 cm", "6", False),
    (r"45^\circ", "90", False), ("10 apples", "10", True), (r"20\mbox{ units}", "20", True), ("2m", "2", False),
    ("7 km", "7", True),
    # thousands separators
    ("1,000", "1000", True), ("1{,}000", "1000", True), (r"1\,000", "1000", True), ("12,345,678", "12345678", True),
    (r"\$1,234.50", "1234.5", True), ("1,000", "100", False), ("10,000", "1000", False),
    # leading zeros and signs
    ("007", "7", True), ("0.070", "0.07", True), ("00", "0", True), ("-007", "-7", True), ("−5", "-5", True),
    ("070", "7", False), ("+3", "3", True), ("-3", "3", False),
    # intervals
    ("(0,1]", "(0, 1]", True), (r"[1,\infty)", r"[1, \infty)", True), ("(0,1)", "[0,1]", False),
    ("(0,1]", "[0,1)", False), (r"(-\infty,0)\cup(1,\infty)", r"(1,\infty)\cup(-\infty,0)", True),
    (r"(-\infty, 0) \cup (1, \infty)", r"(-\infty,0)\cup[1,\infty)", False),
    (r"\left[\frac{1}{2}, 2\right)", "[0.5,2)", True),
    (r"[-\sqrt{2}, \sqrt{2}]", r"[-\sqrt2,\sqrt2]", True), ("[2,3]", "[2,4]", False),
    # tuples, sets and lists
    ("(1,2)", "(1, 2)", True), ("(1,2)", "(2,1)", False), (r"\left(\frac{1}{2}, 3\right)", "(0.5,3)", True),
    ("(1,2,3)", "(1,2)", False), (r"\{1,2,3\}", r"\{3,2,1\}", True), (r"\{1,2\}", r"\{1,3\}", False),
    ("1, 2", "2, 1", True), ("x=1, 2", "1,2", True), ("1,2,2", "1,2", False), ("(3, -1)", "(3,-1)", True),
    (r"(\sqrt{4}, 1)", "(2, 1)", True), ("(1,2),(3,4)", "(3, 4), (1, 2)", True), ("(1,2),(3,4)", "(1,2),(4,3)", False),
    # equations, text and multiple choice
    ("x = 5", "5", True), ("y=-2", "-2", True), ("x = 5", "6", False), (r"\text{(B)}", "B", True),
    ("(C)", "c", True), ("(A)", "B", False), ("Yes", "yes", True), ("no", "yes", False), (r"\text{odd}", "odd", True),
    # malformed or empty
    ("", "5", False), (r"\frac{1}{", "0.5", False), ("__import__('os').system('true')", "0", False),
    ("5.", "5", True),
]


@pytest.fixture(scope="module")
def checker():
  # No comparison here may time out (a timeout reads as "not equal"): each takes milliseconds, so 60 s only guards
  # against a hang, however loaded the machine. The timeout itself is tested below with a job that never ends.
  c = sympy_check.SymbolicChecker(workers=2, timeout_s=60.0)
  yield c
  c.close()


def test_table_is_large_and_covers_both_verdicts():
  assert len(PAIRS) >= 100
  assert sum(e for _, _, e in PAIRS) > 30 and sum(not e for _, _, e in PAIRS) > 30


@pytest.mark.parametrize("prediction,reference,expected", PAIRS)
def test_pair(prediction, reference, expected, checker):
  assert math_equal.equivalent(prediction, reference, checker=checker) is expected
  assert math_equal.equivalent(reference, prediction, checker=checker) is expected, "not symmetric"


@pytest.mark.parametrize("text,answer", [
    (r"so the area is $\boxed{\frac{\sqrt{3}}{4}}$.", r"\frac{\sqrt{3}}{4}"),
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"\boxed 7 is it", "7"),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("#### 1,000\nextra", "1,000"),
    ("Thus, the answer is $\\frac{1}{2}$.", r"\frac{1}{2}"),
    ("The final answer is 42.", "42"),
    ("We get 3, then 5, and finally -12.5 apples", "-12.5"),
    ("I have no idea", None),
    (r"\boxed{\frac{1}{2}", None),
])
def test_extract_answer(text, answer):
  assert math_answer.extract_answer(text) == answer


@pytest.mark.parametrize("source", ["__import__('os')", r"\alpha", "lambda: 1", "x.__class__", "a" * 400,
                                   "open(1)", "eval(1)"])
def test_to_sympy_refuses_unsafe_or_unknown_input(source):
  assert latex.to_sympy(source) is None


def test_symbolic_timeout_kills_the_worker_and_the_next_call_works():
  # Factoring F9 = 2^512 + 1 needs its 49-digit prime factor: sympy was still at it after 40 s here, so the call
  # cannot end within 0.5 s on any machine (F8 = 2^256 + 1, used before, factors in ~2 s with sympy's ECM: a fast
  # machine could finish it in time). The calls that must succeed each start a fresh worker, whose first comparison
  # gets the checker's 30 s start-up allowance on top.
  with_timeout = sympy_check.SymbolicChecker(workers=1, timeout_s=0.5)
  try:
    assert with_timeout.equal("1", "1") is True  # warm the worker (sympy import)
    assert with_timeout.equal("factorint(2**512 + 1)", "1") is None
    assert with_timeout.timeouts == 1
    assert with_timeout.equal("2*x", "x+x") is True
  finally:
    with_timeout.close()


def test_checker_is_thread_safe(checker):
  results = {}

  def compare(i):
    results[i] = checker.equal(f"{i}*x + x", f"{i + 1}*x")

  threads = [threading.Thread(target=compare, args=(i,)) for i in range(16)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert results == {i: True for i in range(16)}
