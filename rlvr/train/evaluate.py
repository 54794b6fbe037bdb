"""Greedy held-out accuracy: the fraction of questions whose correctness reward is 1."""

from __future__ import annotations

from rlvr.rewards import RewardFn, as_completions
from rlvr.rollout import Sampler, SamplingParams
from rlvr.tasks import reward_columns


def evaluate(
    sampler: Sampler,
    rows: list[dict],
    check: RewardFn,
    batch_size: int,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
) -> float:
    """Greedy decoding (one completion per prompt) through ``sampler``, scored by ``check``."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop=stop)
    correct = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [r["prompt"] for r in chunk]
        groups = sampler.sample(prompts, 1, greedy, seed=0)
        scores = check(prompts=prompts, completions=as_completions(prompts, groups.texts), **reward_columns(chunk, 1))
        correct += sum(1.0 for s in scores if s == 1.0)
    return correct / max(len(rows), 1)
