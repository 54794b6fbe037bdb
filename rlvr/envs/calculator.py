"""The built-in ``calculator`` tool: exact arithmetic on integers and decimals.

The expression is parsed with ``ast`` and only numbers, parentheses, unary + and -, and the binary operators
+ - * / // % ** are accepted; everything else (names, calls, attributes, subscripts, strings, comparisons) is
refused before anything is evaluated, so nothing is ever ``eval``-ed. Values are ``fractions.Fraction``: decimals
are read from their source text (``0.1`` is exactly 1/10), so ``0.1 + 0.2`` is exactly ``0.3``.

Bounds, so that no expression crashes or hangs: at most ``MAX_CHARS`` characters; every number (literals and
intermediate results, numerator and denominator) below ``10**MAX_DIGITS``; exponents integral and at most
``MAX_EXPONENT`` in size, and a power whose result would be too large is refused before it is computed
(``9**9**9`` is refused in microseconds). Evaluation is iterative (no recursion limit to hit).

Output: an integer when the value is integral, else the exact decimal when it has at most ``SHOWN_DIGITS``
significant digits, else the value rounded to ``SHOWN_DIGITS`` significant digits followed by ``(rounded)``.
Errors raise ``ToolError`` with one line that says what to write instead.

NOT supported: functions (sqrt, sin, ...), fractional powers, constants (pi, e), variables, ``^`` as power.
NOT protected: it runs in the caller's process, with no deadline of its own (the bounds above keep a call to
milliseconds; ``run_tool_call`` adds the deadline). ``ast.parse`` itself is CPython's parser on at most
``MAX_CHARS`` characters.
"""

from __future__ import annotations

import ast
import decimal
import math
import re
from fractions import Fraction

from rlvr.envs.tools import ToolError

MAX_CHARS = 1_000
MAX_DIGITS = 1_000
MAX_EXPONENT = 10_000
SHOWN_DIGITS = 15
LIMIT = 10**MAX_DIGITS
ALLOWED = "use numbers, parentheses and + - * / // % ** only"
_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.Pow: "**"}
_REFUSED = {ast.Name: "names are", ast.Call: "function calls are", ast.Attribute: "attributes are",
            ast.Subscript: "subscripts are", ast.Compare: "comparisons are", ast.BoolOp: "and/or are",
            ast.Lambda: "lambdas are"}
_DECIMAL = re.compile(r"(\d*)\.?(\d*)(?:[eE]([+-]?\d+))?")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. 123456 * 789 or (2.5 + 1) / 7.

    Args:
        expression: Numbers, parentheses and the operators + - * / // % ** (power).
    """
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ToolError(f"empty expression; write one such as 2 * (3 + 4): {ALLOWED}")
    if len(text) > MAX_CHARS:
        raise ToolError(f"expression is {len(text)} characters long; the limit is {MAX_CHARS}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a null byte
        raise ToolError(f"not an arithmetic expression: {ALLOWED}") from None
    for node in ast.walk(tree.body):
        _check_node(node)
    return _format(_evaluate(tree.body, text))


def _check_node(node: ast.AST) -> None:
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        op = type(node.op)
        if op is ast.BitXor:
            raise ToolError("^ is not a power here: use ** (e.g. 2 ** 10)")
        if op not in _BINARY and op not in (ast.USub, ast.UAdd):
            raise ToolError(f"operator {type(node.op).__name__} is not allowed: {ALLOWED}")
    elif isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            raise ToolError(f"only numbers are allowed, found {type(node.value).__name__}: {ALLOWED}")
    elif (word := next((w for t, w in _REFUSED.items() if isinstance(node, t)), None)) is not None:
        raise ToolError(f"{word} not allowed: {ALLOWED}")
    elif not isinstance(node, ast.operator | ast.unaryop):
        raise ToolError(f"{type(node).__name__} is not allowed: {ALLOWED}")


def _number(node: ast.Constant, text: str) -> Fraction:
    if isinstance(node.value, int):
        return _bounded(Fraction(node.value))
    # A float literal: read its source text, so 0.1 is exactly 1/10 (never the binary float).
    source = (ast.get_source_segment(text, node) or "").replace("_", "")
    match = _DECIMAL.fullmatch(source)
    if not match or not (match[1] or match[2]):
        raise ToolError(f"cannot read the number {source[:40]!r}: {ALLOWED}")
    if match[3] and abs(int(match[3])) > MAX_DIGITS + MAX_CHARS:
        raise ToolError(f"the number {source[:40]} has more than {MAX_DIGITS} digits (the limit)")
    return _bounded(Fraction(source))


def _bounded(x: Fraction) -> Fraction:
    if abs(x.numerator) >= LIMIT or x.denominator >= LIMIT:
        raise ToolError(f"a number in the calculation has more than {MAX_DIGITS} digits (the limit)")
    return x


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ToolError("only whole-number exponents are supported (no roots)")
    n = exponent.numerator
    if abs(n) > MAX_EXPONENT:
        raise ToolError(f"exponent {n} is larger than {MAX_EXPONENT} (the limit)")
    if base == 0 and n < 0:
        raise ToolError("division by zero")
    if base.denominator == 1 and abs(base.numerator) <= 1:
        return base**n
    # Digits of the result ~ |n| * log10 of the larger part: refuse before computing a huge power.
    if abs(n) * max(math.log10(abs(base.numerator) or 1), math.log10(base.denominator)) > MAX_DIGITS + 1:
        raise ToolError(f"the power would have more than {MAX_DIGITS} digits (the limit)")
    return base**n


def _apply(op: type, left: Fraction, right: Fraction) -> Fraction:
    if op is ast.Pow:
        return _bounded(_power(left, right))
    if op in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
        raise ToolError("division by zero")
    ops = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__,
           ast.Div: Fraction.__truediv__, ast.FloorDiv: lambda a, b: Fraction(a // b), ast.Mod: Fraction.__mod__}
    return _bounded(ops[op](left, right))


def _evaluate(root: ast.AST, text: str) -> Fraction:
    """Post-order over the checked tree with an explicit stack."""
    values: list[Fraction] = []
    stack: list[tuple[ast.AST, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if isinstance(node, ast.Constant):
            values.append(_number(node, text))
        elif not children_done:
            stack.append((node, True))
            children = [node.operand] if isinstance(node, ast.UnaryOp) else [node.left, node.right]
            stack.extend((child, False) for child in reversed(children))  # left is evaluated first
        elif isinstance(node, ast.UnaryOp):
            values.append(-values.pop() if isinstance(node.op, ast.USub) else values.pop())
        else:
            right, left = values.pop(), values.pop()
            values.append(_apply(type(node.op), left, right))
    return values[0]


def _format(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    context = decimal.Context(prec=SHOWN_DIGITS, rounding=decimal.ROUND_HALF_EVEN)
    shown = context.divide(decimal.Decimal(x.numerator), decimal.Decimal(x.denominator))
    rounded = context.flags[decimal.Inexact]
    return f"{shown} (rounded)" if rounded else str(shown)
