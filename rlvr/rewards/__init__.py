"""Reward functions (TRL signature), built-ins, and their weighted combination.

A reward named in a config is a built-in (``math_correct``) or ``module:function``, imported like Python imports
a module: see ``build_reward`` and ``reward_search_path``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from rlvr.rewards.arithmetic import arithmetic_correct
from rlvr.rewards.base import (
    PLACEHOLDERS,
    RewardError,
    RewardFn,
    Scores,
    WeightedReward,
    as_completions,
    check_rewards,
    completion_text,
    score_completions,
)
from rlvr.rewards.code import code_tests
from rlvr.rewards.compiled import compiled_tests
from rlvr.rewards.equations import equations_correct, steps_correct
from rlvr.rewards.format import format_match, refusal, reply_form, tool_success
from rlvr.rewards.imports import RewardImportError, _import_module, _public_callables, import_object, reward_search_path
from rlvr.rewards.judge import judge
from rlvr.rewards.length import no_reward, overlong_penalty
from rlvr.rewards.math import math_correct
from rlvr.rewards.reward_model import reward_model
from rlvr.rewards.similarity import similarity

# Built-in names map to factories that take the configured keyword arguments.
BUILTINS = {
    "arithmetic_correct": arithmetic_correct,
    "code_tests": code_tests,
    "compiled_tests": compiled_tests,
    "equations_correct": equations_correct,
    "format": format_match,
    "judge": judge,
    "math_correct": math_correct,
    "no_reward": no_reward,
    "overlong_penalty": overlong_penalty,
    "refusal": refusal,
    "similarity": similarity,
    "reply_form": reply_form,
    "reward_model": reward_model,
    "steps_correct": steps_correct,
    "tool_success": tool_success,
}


def _check_kwargs(name: str, fn: Any, kwargs: dict[str, Any], what: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none
        return
    try:
        signature.bind_partial(**kwargs)
    except TypeError as err:
        named = [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        takes = ", ".join(n for n in named if n not in ("prompts", "completions")) or "none"
        raise RewardImportError(f"reward {name!r}: kwargs {kwargs} do not fit {what} ({err}); the keyword "
                                f"arguments it takes: {takes}") from None


def build_reward(name: str, kwargs: dict[str, Any] | None = None) -> RewardFn:
    """A built-in by name, or any importable function given as ``package.module:function``.

    ``kwargs`` (a config's ``rewards[].kwargs``) go to a built-in's factory, or are bound to the imported function
    (``functools.partial``). ``module`` is imported from the working directory, the folders set by
    ``reward_search_path`` (the config's folder under the CLI), then ``sys.path``; ``__main__:function`` names a
    function of the script that is running, for a script that builds its config and calls ``rlvr.launch.train``.
    Every failure is one ``RewardImportError`` line: a module not found (naming where it looked and what to do),
    a module whose own import raised (naming that error), a missing function (listing the module's public
    callables), kwargs the function does not take.
    """
    kwargs = dict(kwargs or {})
    if name in BUILTINS:
        factory = BUILTINS[name]
        _check_kwargs(name, factory, kwargs, f"the built-in {name}")
        return factory(**kwargs)
    module_name, colon, attr = name.partition(":")
    if not colon:
        raise RewardImportError(
            f"unknown reward {name!r}: use a built-in ({', '.join(sorted(BUILTINS))}) or 'package.module:function'"
        )
    if not module_name or not attr:
        raise RewardImportError(f"reward {name!r}: write a function of your own as 'package.module:function'")
    module = _import_module(name, module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        where = getattr(module, "__file__", None) or module_name
        public = _public_callables(module)
        has = (f"{module_name}.{attr} is a {type(fn).__name__}, not a function" if fn is not None
               else f"module {module_name!r} ({where}) has no function {attr!r}")
        listing = f"its public callables: {', '.join(public)}" if public else "it defines no public function"
        hint = ""
        if module_name == "__main__":
            hint = (f"; __main__ is the program that is running ({where}), so __main__:{attr} works only from "
                    "your own script that defines the function and calls rlvr.launch.train")
        raise RewardImportError(f"reward {name!r}: {has}; {listing}{hint}")
    if kwargs:
        _check_kwargs(name, fn, kwargs, f"{module_name}.{attr}")
        return functools.partial(fn, **kwargs)
    return fn


__all__ = [
    "BUILTINS",
    "PLACEHOLDERS",
    "RewardError",
    "RewardFn",
    "RewardImportError",
    "Scores",
    "WeightedReward",
    "as_completions",
    "build_reward",
    "check_rewards",
    "completion_text",
    "import_object",
    "reward_search_path",
    "score_completions",
]
