"""Code correctness: run the completion's Python in the sandbox against the row's tests.

The test format is recognised per row from the dataset's columns (see ``rlvr.verifiers.code_formats``):
input/output calls (``entry_point`` + ``tests: [{"input", "output"}]``), stdin/stdout programs (``tests:
[{"stdin", "stdout"}]``), HumanEval (``test`` defining ``check(candidate)`` + ``entry_point``) or MBPP
(``test_list`` of asserts, optional ``test_setup_code`` / ``test_imports``). The code is the last fenced
```python block of the completion, else the last fenced block, else the whole completion. Score: 1.0 when
every test passes (or the fraction passed, with ``partial_credit``), None when the sandbox itself failed
(excluded from training, counted).
"""

from __future__ import annotations

import re

from rlvr.rewards.base import RewardFn, completion_text
from rlvr.verifiers.code_formats import make_job, score
from rlvr.verifiers.sandbox import Limits, Sandbox

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
TEST_COLUMNS = ("entry_point", "tests", "test", "test_list", "test_setup_code", "test_imports")


def extract_code(text: str) -> str:
    blocks = _FENCE.findall(text)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else text


def prompt_code(prompt) -> str:
    """The code in a prompt (HumanEval's signature and docstring): its last fenced block, else all of it."""
    if not isinstance(prompt, str):  # chat messages: the last user turn
        users = [m["content"] for m in prompt if m.get("role") == "user"]
        prompt = users[-1] if users else ""
    return extract_code(prompt)


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
    renamed = {"entry_point": entry_point_column, "tests": tests_column}

    def code_reward(prompts, completions, **columns) -> list[float | None]:
        present = {name: renamed.get(name, name) for name in TEST_COLUMNS if renamed.get(name, name) in columns}
        if not {"tests", "test", "test_list"} & set(present):
            raise KeyError(f"code_tests needs test columns ({', '.join(TEST_COLUMNS)}); columns are {sorted(columns)}")
        if "sandbox" not in holder:
            holder["sandbox"] = Sandbox(slots=slots, limits=limits, allow_unsandboxed=allow_unsandboxed)
        sandbox = holder["sandbox"]
        rows = [{name: columns[column][i] for name, column in present.items()} for i in range(len(completions))]
        jobs = [
            make_job(row, extract_code(completion_text(c)), prompt_code(p))
            for row, c, p in zip(rows, completions, prompts)
        ]
        scores = [score(run, row) for run, row in zip(sandbox.execute_many(jobs), rows)]
        if partial_credit:
            return scores
        return [None if s is None else float(s == 1.0) for s in scores]

    return code_reward
