"""The arithmetic task's own check: exact integer match of the last number in the completion."""

from __future__ import annotations

import re

from rlvr.rewards.base import RewardFn, completion_text

_INTEGER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+")  # 1,234 is one number; "1,2" is two


def last_integer(text: str) -> int | None:
    found = _INTEGER.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def arithmetic_correct(answer_column: str = "answer") -> RewardFn:
    """1.0 when the last integer in the completion equals the answer, else 0.0 (exact integer match;
    thousands separators accepted)."""

    def arithmetic_reward(prompts, completions, **columns) -> list[float | None]:
        golds = columns[answer_column]
        return [1.0 if last_integer(completion_text(c)) == int(g) else 0.0 for c, g in zip(completions, golds)]

    return arithmetic_reward
