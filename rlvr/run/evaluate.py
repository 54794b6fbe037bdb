"""Greedy held-out accuracy: the fraction of questions whose correctness reward is 1 (with tools, on episodes)."""

from __future__ import annotations

from rlvr.rewards import RewardFn, WeightedReward
from rlvr.rollout import Sampler, SamplingParams
from rlvr.run.scoring import EnvironmentSetup, sample_scored


def evaluate(
    sampler: Sampler,
    rows: list[dict],
    check: RewardFn,
    batch_size: int,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    env_setup: EnvironmentSetup | None = None,
) -> float:
    """Greedy decoding (one completion, or one episode, per prompt) through ``sampler``, scored by ``check``."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop=stop)
    reward = [WeightedReward("check", check)]
    correct = 0.0
    for start in range(0, len(rows), batch_size):
        got = sample_scored(sampler, rows[start : start + batch_size], 1, greedy, 0, reward, env_setup)
        correct += float((got.scores.per_function["check"] == 1.0).sum())
    return correct / max(len(rows), 1)
