"""Sandbox executions/s and per-execution overhead; math-verifier checks/s.

    python benchmarks/verifiers.py        # writes benchmarks/results/verifiers.json and a BENCHMARKS.md section
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from benchmarks.report import publish
from rlvr.verifiers.math import MathVerifier
from rlvr.verifiers.sandbox import Limits, Sandbox

CODE = "def solve(x):\n    return x + 1\n"


def bare_python_seconds(python: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([python, "-I", "-S", "-B", "-c", "pass"], check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def sandbox_numbers(repeats: int = 30, batch: int = 64) -> dict:
    results = {}
    box = Sandbox(slots=1, limits=Limits(timeout_s=10))
    results["isolation"] = box.mode
    single = []
    for _ in range(repeats):
        started = time.perf_counter()
        run = box.run(CODE, "solve", [[1]])
        single.append(time.perf_counter() - started)
        assert run.outputs == {0: "2"}, run
    box.close()
    bare = bare_python_seconds(box.python, repeats)
    results["execution_s_median"] = statistics.median(single)
    results["bare_python_s_median"] = bare
    results["overhead_s"] = statistics.median(single) - bare
    for slots in (1, 2, 4):
        box = Sandbox(slots=slots, limits=Limits(timeout_s=10))
        started = time.perf_counter()
        runs = box.run_many([(CODE, "solve", [[i]]) for i in range(batch)])
        elapsed = time.perf_counter() - started
        box.close()
        assert all(r.outputs == {0: str(i + 1)} for i, r in enumerate(runs))
        results[f"executions_per_s_slots{slots}"] = batch / elapsed
    return results


def math_numbers() -> dict:
    from tests.verifiers.test_math_verifier import CASES

    preds, golds, _ = zip(*CASES)
    verifier = MathVerifier(workers=2, timeout_s=5)
    verifier.check("1", "1")  # start-up excluded
    started = time.perf_counter()
    verifier.score(list(golds), list(preds))
    elapsed = time.perf_counter() - started
    verifier.close()
    return {"math_checks": len(CASES), "math_checks_per_s_2_workers": len(CASES) / elapsed}


def main() -> None:
    results = {"machine": describe(), **sandbox_numbers(), **math_numbers()}
    md = f"""## Verifiers (`python benchmarks/verifiers.py`)

Machine: {results['machine']}. Isolation mechanism in use: `{results['isolation']}` (PID + network + mount
namespaces via `unshare`, rlimits via `prlimit`, a dedicated uid per slot).

| measurement | value |
|---|---|
| one sandboxed execution (trivial function, 1 test), median | {results['execution_s_median'] * 1000:.0f} ms |
| bare `python -I -S -B -c pass`, median | {results['bare_python_s_median'] * 1000:.0f} ms |
| per-execution sandbox overhead (difference) | {results['overhead_s'] * 1000:.0f} ms |
| executions/s, 1 slot | {results['executions_per_s_slots1']:.1f} |
| executions/s, 2 slots | {results['executions_per_s_slots2']:.1f} |
| executions/s, 4 slots | {results['executions_per_s_slots4']:.1f} |
| math checks/s, 2 worker processes ({results['math_checks']}-case table) | \
{results['math_checks_per_s_2_workers']:.0f} |
"""
    publish("verifiers", results, md)
    print(md)


if __name__ == "__main__":
    main()
