"""Code correctness: run the completion's Python in the sandbox against the row's input/output tests.

Dataset columns: ``entry_point`` (function name) and ``tests``, a list of ``{"input": [args...],
"output": value}`` (JSON values). The code is the last fenced ```python block of the completion, else
the last fenced block, else the whole completion. Score: 1.0 when every test passes (or the fraction
passed, with ``partial_credit``), None when the sandbox itself failed (excluded from training, counted).
"""

from __future__ import annotations

import re

from rlvr.rewards.base import RewardFn, completion_text
from rlvr.verifiers.sandbox import Limits, Sandbox, grade

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    blocks = _FENCE.findall(text)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else text


def code_tests(
    entry_point_column: str = "entry_point",
    tests_column: str = "tests",
    partial_credit: bool = False,
    slots: int = 2,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    allow_unsandboxed: bool = False,
) -> RewardFn:
    """Reward factory; the sandbox is created (and its isolation checked) on first use."""
    limits = Limits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s + 0.999)), memory_mb=memory_mb)
    holder: dict[str, Sandbox] = {}

    def code_reward(prompts, completions, **columns) -> list[float | None]:
        for column in (entry_point_column, tests_column):
            if column not in columns:
                raise KeyError(f"code_tests needs a dataset column {column!r}; columns are {sorted(columns)}")
        if "sandbox" not in holder:
            holder["sandbox"] = Sandbox(slots=slots, limits=limits, allow_unsandboxed=allow_unsandboxed)
        sandbox = holder["sandbox"]
        tests = columns[tests_column]
        jobs = [
            (extract_code(completion_text(c)), entry, [t["input"] for t in case])
            for c, entry, case in zip(completions, columns[entry_point_column], tests)
        ]
        scores = [grade(run, [t["output"] for t in case]) for run, case in zip(sandbox.run_many(jobs), tests)]
        if partial_credit:
            return scores
        return [None if s is None else float(s == 1.0) for s in scores]

    return code_reward
