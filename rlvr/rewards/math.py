"""Math answer correctness: ``rlvr.verifiers.math`` (extraction rules, math-verify, killable timeouts)."""

from __future__ import annotations

from rlvr.rewards.base import RewardFn, completion_text
from rlvr.verifiers.math import MathVerifier


def math_correct(answer_column: str = "answer", workers: int = 2, timeout_s: float = 5.0) -> RewardFn:
    """1.0 when the completion's final answer equals the gold answer in ``answer_column``, else 0.0.

    A gold answer that cannot be parsed, or a verifier process that dies, yields None (not scorable),
    never 0. The worker pool starts on first use.
    """
    verifier = MathVerifier(workers=workers, timeout_s=timeout_s)

    def math_correct_reward(prompts, completions, **columns) -> list[float | None]:
        if answer_column not in columns:
            raise KeyError(f"math_correct needs a dataset column {answer_column!r}; columns are {sorted(columns)}")
        return verifier.score([str(g) for g in columns[answer_column]], [completion_text(c) for c in completions])

    math_correct_reward.verifier = verifier  # type: ignore[attr-defined]
    return math_correct_reward
