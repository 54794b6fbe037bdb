"""The reward-function protocol and how several functions combine.

A reward function has TRL's signature::

    f(prompts, completions, **columns) -> list[float | None]

``prompts`` are the dataset prompts (a string or a list of chat messages), ``completions`` the sampled
answers - plain strings for string prompts, ``[{"role": "assistant", "content": text}]`` for chat prompts,
as TRL passes them - and ``columns`` every other dataset column (one value per completion) plus
``completion_ids`` (lists of token ids). A TRL reward function therefore works unchanged.

Combination policy: the total is the weighted sum of the values that are present. ``None`` (or NaN)
means "this function does not apply to / could not score this completion" and contributes nothing; a
completion that no function scored has no reward (NaN) and is excluded from the update. Missing values
are counted per function in the metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

RewardFn = Callable[..., list]


@dataclass(frozen=True)
class WeightedReward:
    name: str
    fn: RewardFn
    weight: float = 1.0


def completion_text(completion: Any) -> str:
    """The text of a completion in either TRL format (string, or list of chat messages)."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion)


def as_completions(prompts: list, texts: list[str]) -> list:
    """Completions in TRL's convention: plain text for string prompts, chat messages for chat prompts."""
    return [t if isinstance(p, str) else [{"role": "assistant", "content": t}] for p, t in zip(prompts, texts)]


def _as_float(value: Any, name: str, index: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value)
        raise TypeError(f"reward function {name!r} returned {type(value).__name__} at index {index}; expected float or None")
    return float(value)


def score_completions(
    rewards: Sequence[WeightedReward],
    prompts: list,
    completions: list,
    columns: dict[str, list],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run every reward function once over the batch.

    Returns:
        total [N] float32 (NaN where no function scored), and per-function values {name: [N]} (NaN = None).
    """
    n = len(completions)
    per_fn: dict[str, torch.Tensor] = {}
    total = torch.zeros(n, dtype=torch.float64)
    scored = torch.zeros(n, dtype=torch.bool)
    for reward in rewards:
        values = reward.fn(prompts=prompts, completions=completions, **columns)
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(f"reward function {reward.name!r} returned {got} values for {n} completions; it must return a list of {n}")
        v = torch.tensor([_as_float(x, reward.name, i) for i, x in enumerate(values)], dtype=torch.float64)
        per_fn[reward.name] = v.float()
        present = ~torch.isnan(v)
        total += torch.where(present, reward.weight * v, torch.zeros_like(v))
        scored |= present
    total = torch.where(scored, total, torch.full_like(total, math.nan))
    return total.float(), per_fn
