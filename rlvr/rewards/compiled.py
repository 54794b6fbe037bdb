"""Compiled-language code correctness: build the completion's C, C++, Rust, Java or JavaScript in the sandbox and
judge it by the row's tests (``rlvr.verifiers.compiled``: MultiPL-E assertion programs or stdin/stdout cases).

Rows: ``language`` (c, cpp / c++, rust / rs, java, javascript / js) and ``tests`` - a test program (string,
MultiPL-E's form: the prompt is the code the completion continues, cut at ``stop_tokens``) or a list of
``{"input": str, "output": str}`` cases (``stdin``/``stdout`` keys too; the code is the completion's last fenced
block, else all of it). Score: 1.0 when every test passes (the pass fraction with ``partial_credit``),
``compile_error_reward`` when it does not build, None when the sandbox itself failed (excluded, counted). Each
batch logs the share of each outcome as ``reward_log/compiled/<outcome>`` (passed, wrong_answer, compile_error,
timeout, runtime_error, memory, output_limit, exited_early, checker_error, ...).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from rlvr.rewards.base import RewardConfigError, RewardFn, completion_text
from rlvr.rewards.code import prompt_code
from rlvr.rewards.imports import import_object
from rlvr.verifiers.compiled import OUTCOMES, Settings
from rlvr.verifiers.compiled_judge import CheckerProgram, CompiledJudge, Program, ToolchainMissing, require_toolchains
from rlvr.verifiers.languages import language as language_entry


def compiled_tests(
    language_column: str = "language",
    tests_column: str = "tests",
    language: str | None = None,
    languages: list[str] | None = None,
    partial_credit: bool = False,
    compile_error_reward: float = 0.0,
    float_tolerance: float = 0.0,
    cpu_s: float = 2.0,
    compile_cpu_s: float = 20.0,
    memory_mb: int = 1024,
    slots: int = 0,
    cache_mb: int = 256,
    checker: str | None = None,
    checker_column: str = "checker",
    allow_unsandboxed: bool = False,
) -> RewardFn:
    """Reward factory. ``language`` fixes every row's language (else the ``language_column``); the toolchains of
    ``language`` / ``languages`` are checked now, others when a row first names them. ``checker``, for stdio
    problems with several right answers, instead of the token comparison: a checker program's source file
    (``checkers/close.cpp``: any judged language, by its extension; run in the sandbox as testlib's checkers
    are) or ``module:function`` called as ``function(stdin, output, expected) -> bool``. A row's own checker
    program: ``{"language": ..., "source": ...}`` in ``checker_column``. ``slots``: programs built and run at
    once (0: one per core)."""
    try:
        check = _checker(checker) if checker else None
        require_toolchains([n for n in [language, *(languages or [])] if n] +
                           ([check.language] if isinstance(check, CheckerProgram) else []))
    except (ToolchainMissing, ValueError) as err:
        raise RewardConfigError(f"compiled_tests: {err}") from None
    settings = Settings(cpu_s=cpu_s, compile_cpu_s=compile_cpu_s, float_tolerance=float_tolerance)
    judge = CompiledJudge(settings, slots=slots, memory_mb=memory_mb, cache_mb=cache_mb,
                          allow_unsandboxed=allow_unsandboxed, checker=check)

    def compiled_reward(prompts, completions, log_metric=None, **columns) -> list[float | None]:
        if tests_column not in columns or (language is None and language_column not in columns):
            need = [tests_column] + ([] if language else [language_column])
            raise KeyError(f"compiled_tests needs the columns {need}; columns are {sorted(columns)}")
        programs = [_program(i, p, c, columns) for i, (p, c) in enumerate(zip(prompts, completions))]
        try:
            verdicts = judge.judge(programs)
        except ToolchainMissing as err:
            raise RewardConfigError(f"compiled_tests: {err}") from None
        if log_metric is not None and verdicts:  # every outcome each call: the step's mean is then its share
            counts = Counter(v.outcome for v in verdicts)
            for outcome in OUTCOMES:
                log_metric(f"compiled/{outcome}", counts[outcome] / len(verdicts))
        return [_score(v) for v in verdicts]

    def _program(i: int, prompt, completion, columns) -> Program:
        lang = language or columns[language_column][i]
        tests = columns[tests_column][i]
        text = completion_text(completion)
        if isinstance(tests, str):
            stops = columns.get("stop_tokens", [None] * (i + 1))[i]
            return Program(lang, text, tests=tests, prompt=prompt_code(prompt), stop=tuple(stops) if stops else None)
        if isinstance(tests, list) and all(isinstance(t, dict) for t in tests):
            cases = [(_field(t, "input", "stdin"), _field(t, "output", "stdout")) for t in tests]
            own = columns.get(checker_column, [None] * (i + 1))[i]
            return Program(lang, text, cases=cases, checker=_row_checker(i, own) if own else None)
        raise ValueError(f"row {i}: '{tests_column}' must be a test program (string) or a list of "
                         "{\"input\": str, \"output\": str} cases")

    def _score(verdict) -> float | None:
        if verdict.score is None:
            return None
        if verdict.outcome in ("compile_error", "compile_timeout"):
            return compile_error_reward
        return verdict.score if partial_credit else float(verdict.score == 1.0)

    compiled_reward.judge = judge  # for benchmarks and tests: its cache's hits and misses
    return compiled_reward


def _field(case: dict, *names: str) -> str:
    for name in names:
        if isinstance(case.get(name), str):
            return case[name]
    raise ValueError(f"a stdin/stdout case needs a string '{names[0]}' (or '{names[1]}'); got {sorted(case)}")


def _checker(spec: str):
    """A checker program read from its source file (the language from its extension), else an imported function."""
    path = Path(spec)
    if ":" not in spec and path.suffix:
        lang = language_entry(path.suffix[1:])  # ValueError naming the judged languages
        if not path.is_file():
            raise ValueError(f"checker {spec!r}: no such file")
        return CheckerProgram(lang.name, path.read_text(encoding="utf-8"))
    return import_object(spec, "compiled_tests checker")


def _row_checker(i: int, value) -> CheckerProgram:
    well_formed = isinstance(value, dict) and isinstance(value.get("language"), str) \
        and isinstance(value.get("source"), str)
    if not well_formed:  # a dataset's row: a ValueError naming it, as every row error of this reward
        raise ValueError(f"row {i}: a checker must be {{\"language\": str, \"source\": str}}")
    return CheckerProgram(language_entry(value["language"]).name, value["source"])
