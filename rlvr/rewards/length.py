"""Length rewards: DAPO's soft over-length penalty, on completion length in tokens; and no reward at all."""

from __future__ import annotations

from rlvr.rewards.base import RewardFn


def overlong_penalty(max_tokens: int, cache_tokens: int) -> RewardFn:
    """0 up to ``max_tokens - cache_tokens`` tokens, then falling linearly to -1 at ``max_tokens``; -1 beyond.

    Typically ``max_tokens`` is rollout.max_new_tokens, so a truncated completion gets the full -1.
    """
    if not 0 < cache_tokens <= max_tokens:
        raise ValueError(f"overlong_penalty needs 0 < cache_tokens <= max_tokens, got {cache_tokens}, {max_tokens}")
    free = max_tokens - cache_tokens

    def overlong_reward(prompts, completions, completion_ids, **columns) -> list[float | None]:
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= free else -1.0 if n > max_tokens else (free - n) / cache_tokens)
        return out

    return overlong_reward


def no_reward() -> RewardFn:
    """0 for every completion: a run whose only signal is something else (a distillation teacher)."""

    def zero_reward(prompts, completions, **columns) -> list[float | None]:
        return [0.0] * len(completions)

    return zero_reward
