"""Math answer correctness through Hugging Face's ``math-verify`` (parsing + symbolic comparison).

math-verify extracts the answer from LaTeX (``\\boxed{}`` first) or plain expressions and compares it
with the gold answer symbolically (fractions, decimals, thousands separators, simple units). Its
timeouts rely on SIGALRM and so only act on the main thread; a hardened, process-isolated verifier is
tracked separately.
"""

from __future__ import annotations

from math_verify import parse, verify

from rlvr.rewards.base import RewardFn, completion_text


def math_correct(answer_column: str = "answer") -> RewardFn:
    """1.0 when the completion's final answer equals the gold answer in ``answer_column``, else 0.0.

    A gold answer that math-verify cannot parse yields None (not scorable), never 0.
    """

    def math_correct_reward(prompts, completions, **columns) -> list[float | None]:
        if answer_column not in columns:
            raise KeyError(f"math_correct needs a dataset column {answer_column!r}; columns are {sorted(columns)}")
        scores: list[float | None] = []
        for completion, gold in zip(completions, columns[answer_column]):
            gold_parsed = parse(str(gold))
            if not gold_parsed:
                scores.append(None)
                continue
            scores.append(1.0 if verify(gold_parsed, parse(completion_text(completion))) else 0.0)
        return scores

    return math_correct_reward
