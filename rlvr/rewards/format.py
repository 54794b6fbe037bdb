"""Format rewards: does the completion have the shape we ask for?"""

from __future__ import annotations

import re

from rlvr.rewards.base import RewardFn, completion_text

THINK_ANSWER = r"<think>.*?</think>\s*<answer>.*?</answer>"


def format_match(pattern: str = THINK_ANSWER) -> RewardFn:
    """1.0 when the whole (stripped) completion matches ``pattern`` (DOTALL), else 0.0.

    The default is the reasoning-then-answer layout ``<think>...</think><answer>...</answer>``.
    """
    regex = re.compile(pattern, re.DOTALL)

    def format_reward(prompts, completions, **columns) -> list[float | None]:
        return [1.0 if regex.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]

    return format_reward
