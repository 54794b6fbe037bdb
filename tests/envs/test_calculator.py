"""The calculator tool: exact results, and a one-line refusal (never a crash or a hang) for everything else."""

import pytest

from rlvr.envs.calculator import calculator
from rlvr.envs.tools import ToolError

ONLY = "use numbers, parentheses and + - * / // % ** only"


@pytest.mark.parametrize("expression, result", [
    ("123456 * 789", "97406784"),  # 123456 * 789 = 97406784 (123456*800 - 123456*11 = 98764800 - 1358016)
    ("0.1 + 0.2", "0.3"),  # exact decimals: 1/10 + 2/10
    ("0.1 * 3", "0.3"),
    ("(2.5 + 1) / 7", "0.5"),
    ("7 / 2", "3.5"),
    ("-7 / 2", "-3.5"),
    ("1 / 8", "0.125"),
    ("2 ** -3", "0.125"),
    ("1 / 3", "0.333333333333333 (rounded)"),  # 15 significant digits
    ("2 / 3", "0.666666666666667 (rounded)"),
    ("(1 / 3) * 3", "1"),  # exact: no 0.999...
    ("1 / 7 * 7", "1"),
    ("10 ** 20 / 3", "3.33333333333333E+19 (rounded)"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),  # floor, as in Python
    ("7 % 3", "1"),
    ("-7 % 3", "2"),
    ("7.5 % 2", "1.5"),
    ("2 ** 10", "1024"),
    ("-2 ** 2", "-4"),  # ** binds tighter than unary minus, as in Python
    ("(-2) ** 3", "-8"),
    ("--1", "1"),
    ("+-+1", "-1"),
    ("1e3 + 1.5e-3", "1000.0015"),
    ("1_000 * 3", "3000"),
    (".5 + 5.", "5.5"),
    ("0x1f", "31"),
    ("-0.0", "0"),
    ("  2*(3+4)  ", "14"),
    ("1 ** 10000", "1"),  # the exponent bound, with a base that stays small
    ("-" * 999 + "1", "-1"),  # 999 unary minus signs: deep, evaluated without recursion
    ("+".join(["1"] * 500), "500"),
    ("10 ** 999", "1" + "0" * 999),  # 1000 digits: the largest size allowed
])
def test_exact_results(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", f"function calls are not allowed: {ONLY}"),
    ("().__class__", f"attributes are not allowed: {ONLY}"),
    ("x + 1", f"names are not allowed: {ONLY}"),
    ("[1, 2][0]", f"subscripts are not allowed: {ONLY}"),
    ("(1, 2)", f"Tuple is not allowed: {ONLY}"),
    ("lambda: 1", f"lambdas are not allowed: {ONLY}"),
    ("1 if 1 else 2", f"IfExp is not allowed: {ONLY}"),
    ("f'{1}'", f"JoinedStr is not allowed: {ONLY}"),
    ("1 < 2", f"comparisons are not allowed: {ONLY}"),
    ("1 and 2", f"and/or are not allowed: {ONLY}"),
    ("'a' * 3", f"only numbers are allowed, found str: {ONLY}"),
    ("True + 1", f"only numbers are allowed, found bool: {ONLY}"),
    ("2j", f"only numbers are allowed, found complex: {ONLY}"),
    ("~1", f"operator Invert is not allowed: {ONLY}"),
    ("6 & 3", f"operator BitAnd is not allowed: {ONLY}"),
    ("2 ^ 10", "^ is not a power here: use ** (e.g. 2 ** 10)"),
    ("3 *", f"not an arithmetic expression: {ONLY}"),
    ("12 * 9 =", f"not an arithmetic expression: {ONLY}"),
    ("1\x00", f"not an arithmetic expression: {ONLY}"),
    ("(" * 300 + "1" + ")" * 300, f"not an arithmetic expression: {ONLY}"),  # the parser's nesting limit
    ("", f"empty expression; write one such as 2 * (3 + 4): {ONLY}"),
    ("   ", f"empty expression; write one such as 2 * (3 + 4): {ONLY}"),
    ("1 / 0", "division by zero"),
    ("1 // 0", "division by zero"),
    ("1 % (2 - 2)", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 0.5", "only whole-number exponents are supported (no roots)"),
    ("9**9**9", "exponent 387420489 is larger than 10000 (the limit)"),  # 9**(9**9): refused before computing
    ("2 ** 10001", "exponent 10001 is larger than 10000 (the limit)"),
    ("2 ** 10000", "the power would have more than 1000 digits (the limit)"),  # 10000 * log10(2) = 3010 digits
    ("(1/3) ** 3000", "the power would have more than 1000 digits (the limit)"),  # denominator 3**3000
    ("10 ** 999 * 10", "a number in the calculation has more than 1000 digits (the limit)"),  # 1001 digits
    ("1 / 10 ** 999 / 10", "a number in the calculation has more than 1000 digits (the limit)"),  # denominator
    ("1e2000", "a number in the calculation has more than 1000 digits (the limit)"),
    ("1e99999", "the number 1e99999 has more than 1000 digits (the limit)"),  # refused before it is built
    ("1" * 1001, "expression is 1001 characters long; the limit is 1000"),
    ("1+" * 5000 + "1", "expression is 10001 characters long; the limit is 1000"),  # a 10 kB expression
])
def test_refusals_are_one_line(expression, message):
    with pytest.raises(ToolError) as err:
        calculator(expression)
    assert str(err.value) == message


def test_a_non_string_argument_is_refused():
    with pytest.raises(ToolError) as err:
        calculator(12)
    assert str(err.value) == "expression must be a string, got int"
