"""Step-level shaping for multi-step problems, from the calculations a completion writes ("7 - 2 = 5").

- ``equations_correct``: the fraction of written calculations that are right (arithmetic only).
- ``steps_correct``: partial credit against a known chain of intermediate amounts (a task column, e.g.
  word_problems' ``chain``): how many of them the completion's leading calculations reach, in order.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rlvr.rewards.base import RewardFn, completion_text

# "a op b = c" with whole numbers; op one of + - * x × / ÷. Decimals are not calculations of this form.
_EQUATION = re.compile(r"(?<![\d.])(\d+)\s*([-+*x×/÷])\s*(\d+)\s*=\s*(-?\d+)(?![\d.]\d)")


def _value(a: int, op: str, b: int) -> Fraction | None:
    if op == "+":
        return Fraction(a + b)
    if op == "-":
        return Fraction(a - b)
    if op in "*x×":
        return Fraction(a * b)
    return Fraction(a, b) if b else None


def _calculations(text: str) -> list[tuple[bool, int]]:
    """(right?, written result) of each calculation in ``text``, in order of writing."""
    return [(_value(int(a), op, int(b)) == int(r), int(r)) for a, op, b, r in _EQUATION.findall(text)]


def equations_correct() -> RewardFn:
    """Per completion: right calculations / written calculations, 0.0 when it writes none.

    A shaping term for multi-step problems (weight it well below the answer's reward): it scores the steps of a
    chain that ends wrong, so a group whose answers are all wrong still tells right arithmetic from wrong.
    Only the arithmetic is checked, not whether a step belongs to the problem.
    """

    def equations_reward(prompts, completions, **columns) -> list[float | None]:
        out = []
        for c in completions:
            found = _calculations(completion_text(c))
            out.append(sum(right for right, _ in found) / len(found) if found else 0.0)
        return out

    return equations_reward


def steps_correct(chain_column: str = "chain", all_steps: bool = False) -> RewardFn:
    """Per completion: k / n, where the gold chain holds the amounts v1..vn after each step of the problem and
    the completion's first k calculations are right and give v1..vk. A two-step problem solved half-way
    scores 0.5, solved 1.0. Only the leading calculations count: a completion cannot collect credit by
    writing many calculations and hoping some land on the chain (measured: with any calculation allowed in
    between, the 135M model learned to write until the token limit - docs/experiments/word_problems.md).

    Pair it with the answer's reward at a lower weight: a group whose answers are all wrong then still ranks
    the samples that got the first step right above those that did not - the signal sparse multi-step
    problems lack.

    ``all_steps``: credit only a completion that writes exactly n calculations (one per step); one that stops
    early or runs on scores 0. Without it, doing the first step and stopping is a cheap way to collect credit
    on a two-step problem (measured: the 135M model learned exactly that - docs/experiments/word_problems.md).
    """

    def steps_reward(prompts, completions, **columns) -> list[float | None]:
        if chain_column not in columns:
            raise KeyError(f"steps_correct needs a dataset column {chain_column!r} (the amount after each step); "
                           f"columns are {sorted(columns)}")
        out = []
        for c, chain in zip(completions, columns[chain_column]):
            gold = [int(v) for v in chain]
            if not gold:
                out.append(None)
                continue
            found = _calculations(completion_text(c))
            if all_steps and len(found) != len(gold):
                out.append(0.0)
                continue
            reached = 0
            for (right, result), want in zip(found, gold):
                if not (right and result == want):
                    break
                reached += 1
            out.append(reached / len(gold))
        return out

    return steps_reward
