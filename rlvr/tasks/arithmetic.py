"""The built-in arithmetic task: ``a op b`` questions generated from a seed, with a disjoint held-out split.

Operands have ``digits`` digits (1 digit means 0-9). Subtraction keeps a >= b so answers are never
negative. Every distinct question lands in exactly one split: the question space is enumerated (or, when
it is larger than ``MAX_ENUMERATED``, sampled without repeats), shuffled with the seed, and the first
``eval_size`` questions are held out.
"""

from __future__ import annotations

import itertools
import random

OPERATORS = ("+", "-", "*")
MAX_ENUMERATED = 200_000


def _operand_range(digits: int) -> range:
    if digits < 1:
        raise ValueError(f"task.digits must be >= 1, got {digits}")
    return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def _questions(digits: int, operators: tuple[str, ...], needed: int, rng: random.Random) -> list[tuple[int, str, int]]:
    operands = _operand_range(digits)
    space = len(operators) * len(operands) ** 2
    if space <= MAX_ENUMERATED:
        qs = [(a, op, b) for op, a, b in itertools.product(operators, operands, operands)]
        qs = [(a, op, b) if op != "-" or a >= b else (b, op, a) for a, op, b in qs]
        qs = sorted(set(qs))
        rng.shuffle(qs)
        return qs
    seen: set[tuple[int, str, int]] = set()
    qs = []
    while len(qs) < needed:
        a, b, op = rng.choice(operands), rng.choice(operands), rng.choice(operators)
        q = (max(a, b), op, min(a, b)) if op == "-" else (a, op, b)
        if q not in seen:
            seen.add(q)
            qs.append(q)
    return qs


def _row(a: int, op: str, b: int, system_prompt: str) -> dict:
    messages = [{"role": "user", "content": f"{a} {op} {b} ="}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return {"prompt": messages, "answer": str(eval(f"{a}{op}{b}"))}  # operands are ints we made


def arithmetic_rows(
    digits: int,
    operators: tuple[str, ...],
    eval_size: int,
    train_size: int,
    seed: int,
    system_prompt: str,
) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows ``{"prompt": messages, "answer": "42"}``; no question is in both.

    ``train_size`` 0 takes every question not held out (capped at what was generated).
    """
    bad = [op for op in operators if op not in OPERATORS]
    if bad or not operators:
        raise ValueError(f"task.operators must be a non-empty subset of {OPERATORS}, got {list(operators)}")
    rng = random.Random(seed)
    questions = _questions(digits, tuple(operators), eval_size + max(train_size, 10_000), rng)
    if len(questions) <= eval_size:
        raise ValueError(f"task.eval_size={eval_size} leaves no training questions out of {len(questions)}")
    held_out, train = questions[:eval_size], questions[eval_size:]
    if train_size:
        train = train[:train_size]
    return [_row(*q, system_prompt) for q in train], [_row(*q, system_prompt) for q in held_out]
