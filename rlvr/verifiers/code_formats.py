"""The test formats code datasets come in, recognised by a row's columns, and how each is graded.

| format      | columns                                              | one test is                     |
|-------------|------------------------------------------------------|---------------------------------|
| `io`        | `entry_point`, `tests: [{"input": [...], "output": v}]` | a call; the trainer compares  |
| `program`   | `tests: [{"stdin": "...", "stdout": "..."}]`         | a run; the trainer compares     |
| `humaneval` | `test` (defines `check(candidate)`), `entry_point`    | the whole `check` (one test)    |
| `mbpp`      | `test_list` (asserts), `test_setup_code`?, `test_imports`? | one assert                 |

Expected values of `io` and `program` tests never enter the sandbox. `program` outputs are compared after
removing trailing whitespace from every line and trailing blank lines. A HumanEval completion may be the
whole function or only its body: if the code alone does not define the entry point, the prompt's code
followed by the completion is tried.

Assert tests see only the names they read and do not bind themselves, never a builtin or a dunder (see
``harness.test_namespace``): MBPP tests get the solution's functions they call; HumanEval tests get the
entry point from the solution and every other name (``poly``, ``encode_cyclic``) from the prompt's code, run
by the checker - so pass the prompt (its code alone, or its last fenced block), or such tests fail.
"""

from __future__ import annotations

from rlvr.verifiers.sandbox import Execution, grade

FORMATS = ("io", "program", "humaneval", "mbpp")


def detect_format(row: dict) -> str:
    """The format of a dataset row; ValueError naming what is missing when it matches none."""
    tests = row.get("tests")
    if isinstance(tests, list) and tests and all(isinstance(t, dict) for t in tests):
        if all(isinstance(t.get("input"), list) and "output" in t for t in tests):
            if _identifier(row.get("entry_point")):
                return "io"
            raise ValueError("input/output tests need 'entry_point', the name of the function to call")
        if all(isinstance(t.get("stdin"), str) and isinstance(t.get("stdout"), str) for t in tests):
            return "program"
    if isinstance(row.get("test"), str) and row["test"].strip():
        if _identifier(row.get("entry_point")):
            return "humaneval"
        raise ValueError("HumanEval-style rows need 'entry_point' next to 'test'")
    test_list = row.get("test_list")
    if isinstance(test_list, list) and test_list and all(isinstance(t, str) and t.strip() for t in test_list):
        setup, imports = row.get("test_setup_code", ""), row.get("test_imports", [])
        if isinstance(setup, str) and isinstance(imports, list) and all(isinstance(t, str) for t in imports):
            return "mbpp"
    raise ValueError(
        "code rows need one of: 'entry_point' + 'tests' [{\"input\": [args...], \"output\": value}]; 'tests' "
        "[{\"stdin\": str, \"stdout\": str}]; HumanEval's 'test' (defining check(candidate)) + 'entry_point'; "
        "or MBPP's 'test_list' (assert strings) with optional 'test_setup_code' and 'test_imports'"
    )


def _identifier(name) -> bool:
    return isinstance(name, str) and name.isidentifier()


def make_job(row: dict, code: str, prompt_code: str | None = None) -> dict:
    """The sandbox job for ``code`` against ``row``'s tests (expected values of io/program rows left out)."""
    fmt = detect_format(row)
    if fmt == "io":
        return {"format": fmt, "sources": [code], "entry_point": row["entry_point"],
                "inputs": [t["input"] for t in row["tests"]]}
    if fmt == "program":
        return {"format": fmt, "sources": [code], "stdins": [t["stdin"] for t in row["tests"]]}
    if fmt == "humaneval":
        sources = [code] + ([prompt_code.rstrip("\n") + "\n" + code] if prompt_code else [])
        return {"format": fmt, "sources": sources, "entry_point": row["entry_point"], "test": row["test"],
                "prompt_code": prompt_code or ""}
    setup = "".join(line + "\n" for line in row.get("test_imports") or []) + (row.get("test_setup_code") or "")
    return {"format": fmt, "sources": [code], "test_list": list(row["test_list"]), "setup_code": setup}


def num_tests(row: dict) -> int:
    fmt = detect_format(row)
    return 1 if fmt == "humaneval" else len(row["test_list"] if fmt == "mbpp" else row["tests"])


def normalise_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def score(execution: Execution, row: dict) -> float | None:
    """Fraction of the row's tests passed; None for an infrastructure failure. A run that timed out as a
    whole or flooded its output earns 0 whatever it reported before."""
    fmt = detect_format(row)
    if fmt == "io":
        return grade(execution, [t["output"] for t in row["tests"]])
    if execution.status == "infra_error":
        return None
    if execution.status != "ran":
        return 0.0
    if fmt == "program":
        passed = sum(
            1 for i, t in enumerate(row["tests"])
            if i in execution.stdouts and execution.stdouts[i][1] == "exit"
            and normalise_output(execution.stdouts[i][0]) == normalise_output(t["stdout"])
        )
    else:
        passed = len(execution.passed & set(range(num_tests(row))))
    return passed / num_tests(row)
