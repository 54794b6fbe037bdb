"""Greedy held-out accuracy: the fraction of questions whose correctness reward is 1."""

from __future__ import annotations

from torch import nn

from rlvr.rewards import RewardFn, as_completions
from rlvr.rollout import SamplingParams, sample_groups
from rlvr.tasks import reward_columns


def evaluate(
    model: nn.Module,
    tokenizer,
    rows: list[dict],
    check: RewardFn,
    batch_size: int,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
) -> float:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop=stop)
    correct = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [r["prompt"] for r in chunk]
        groups = sample_groups(model, tokenizer, prompts, 1, greedy)
        scores = check(prompts=prompts, completions=as_completions(prompts, groups.texts), **reward_columns(chunk, 1))
        correct += sum(1.0 for s in scores if s == 1.0)
    return correct / max(len(rows), 1)
