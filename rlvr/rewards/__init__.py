"""Reward functions (TRL signature), built-ins, and their weighted combination."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from rlvr.rewards.arithmetic import arithmetic_correct
from rlvr.rewards.base import (
    RewardError,
    RewardFn,
    Scores,
    WeightedReward,
    as_completions,
    completion_text,
    score_completions,
)
from rlvr.rewards.code import code_tests
from rlvr.rewards.equations import equations_correct, steps_correct
from rlvr.rewards.format import format_match
from rlvr.rewards.length import overlong_penalty
from rlvr.rewards.math import math_correct

# Built-in names map to factories that take the configured keyword arguments.
BUILTINS = {
    "arithmetic_correct": arithmetic_correct,
    "code_tests": code_tests,
    "equations_correct": equations_correct,
    "format": format_match,
    "math_correct": math_correct,
    "overlong_penalty": overlong_penalty,
    "steps_correct": steps_correct,
}


def build_reward(name: str, kwargs: dict[str, Any] | None = None) -> RewardFn:
    """A built-in by name, or any importable function given as ``package.module:function``."""
    kwargs = dict(kwargs or {})
    if name in BUILTINS:
        return BUILTINS[name](**kwargs)
    if ":" not in name:
        raise ValueError(
            f"unknown reward {name!r}: use a built-in ({', '.join(sorted(BUILTINS))}) or 'package.module:function'"
        )
    module_name, attr = name.split(":", 1)
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {module_name} has no function {attr!r}")  # noqa: TRY004 (bad config)
    return functools.partial(fn, **kwargs) if kwargs else fn


__all__ = [
    "BUILTINS",
    "RewardError",
    "RewardFn",
    "Scores",
    "WeightedReward",
    "as_completions",
    "build_reward",
    "completion_text",
    "score_completions",
]
