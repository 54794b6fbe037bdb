"""examples/judge.yaml's measures that are not its judge: VADER's sentiment of a reply (a rule-based lexicon,
vaderSentiment from PyPI), so that a warmer tone and a fooled judge can be told apart.

- ``positive_reply``: 1.0 when the reply's VADER compound score is at least 0.5 (clearly positive), else 0.0: the
  held-out check (task.eval_reward), so eval/accuracy is the share of clearly positive greedy replies.
- ``sentiment``: the compound score itself, in [-1, 1]; logged with weight 0 during training next to the judge's.
"""

from __future__ import annotations

import functools

from rlvr.rewards.base import completion_text

POSITIVE = 0.5


@functools.cache
def _analyzer():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def compound(text: str) -> float:
    return float(_analyzer().polarity_scores(text)["compound"])


def sentiment(prompts, completions, **_) -> list[float]:
    return [compound(completion_text(c)) for c in completions]


def positive_reply(prompts, completions, **_) -> list[float]:
    return [1.0 if compound(completion_text(c)) >= POSITIVE else 0.0 for c in completions]
