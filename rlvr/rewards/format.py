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


def tool_success() -> RewardFn:
    """For episodes (multi-turn completions): 1.0 when at least one tool call returned a result, 0.0 when every
    call failed (an ``error:`` result: malformed, unknown tool, bad arguments, an exception, a timeout) or the model
    called none. A shaping reward for teaching a model to use its tools: weigh it well below the correctness
    reward, which it does not replace (a call with any valid arguments earns it). Single completions score 0.0."""

    def tool_success_reward(prompts, completions, **columns) -> list[float | None]:
        return [1.0 if not isinstance(c, str) and any(
            m.get("role") == "tool" and not str(m.get("content", "")).startswith("error:") for m in c) else 0.0
            for c in completions]

    return tool_success_reward
