"""Sandbox executions/s and per-execution overhead (against an earlier sandbox, side by side); math-verifier
checks/s.

    python benchmarks/verifiers.py [--baseline 0f6006f]   # writes benchmarks/results/verifiers.json + BENCHMARKS.md

``--baseline REF`` times the sandbox of commit REF (checked out in a temporary git worktree) in the same run:
0f6006f is the last one without the private root filesystem (namespaces and uid only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from benchmarks.report import publish
from rlvr.verifiers.code_formats import make_job
from rlvr.verifiers.math import MathVerifier
from rlvr.verifiers.sandbox import Limits, Sandbox, io_job

CODE = "def solve(x):\n    return x + 1\n"
MBPP_ROW = {"test_list": ["assert solve(1) == 2", "assert solve(5) == 6", "assert solve(-1) == 0"]}
PROGRAM_ROW = {"tests": [{"stdin": "1", "stdout": "2"}, {"stdin": "5", "stdout": "6"}, {"stdin": "-1", "stdout": "0"}]}
PROGRAM = "print(int(input()) + 1)\n"
TIME_OLD = """
import json, statistics, time
from rlvr.verifiers.sandbox import Limits, Sandbox
box = Sandbox(slots=1, limits=Limits(timeout_s=10))
times = []
for _ in range({repeats}):
    started = time.perf_counter()
    run = box.run({code!r}, "solve", [[1]])
    times.append(time.perf_counter() - started)
    assert run.outputs == {{0: "2"}}, run
print(json.dumps(statistics.median(times)))
"""


def baseline_seconds(ref: str, repeats: int) -> float:
    """Median execution time of the sandbox at git ``ref``, in a temporary worktree."""
    with tempfile.TemporaryDirectory(prefix="rlvr-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True,
                       capture_output=True)
        try:
            out = subprocess.run([sys.executable, "-c", TIME_OLD.format(repeats=repeats, code=CODE)], cwd=tree,
                                 check=True, capture_output=True, text=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_seconds(box: Sandbox, job: dict, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        box.execute(job)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bare_python_seconds(python: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([python, "-I", "-S", "-B", "-c", "pass"], check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def sandbox_numbers(repeats: int, batch: int, baseline: str | None) -> dict:
    results = {}
    box = Sandbox(slots=1, limits=Limits(timeout_s=10))
    results["isolation"] = box.mode
    single = []
    for _ in range(repeats):
        started = time.perf_counter()
        run = box.run(CODE, "solve", [[1]])
        single.append(time.perf_counter() - started)
        assert run.outputs == {0: "2"}, run
    results["mbpp_3_asserts_s_median"] = median_seconds(box, make_job(MBPP_ROW, CODE), repeats)
    results["program_3_runs_s_median"] = median_seconds(box, make_job(PROGRAM_ROW, PROGRAM), repeats)
    box.close()
    bare = bare_python_seconds(box.python, repeats)
    results["execution_s_median"] = statistics.median(single)
    results["bare_python_s_median"] = bare
    results["overhead_s"] = statistics.median(single) - bare
    if baseline:
        results["baseline_ref"] = baseline
        results["baseline_execution_s_median"] = baseline_seconds(baseline, repeats)
    for slots in (1, 2, 4):
        box = Sandbox(slots=slots, limits=Limits(timeout_s=10))
        started = time.perf_counter()
        runs = box.execute_many([io_job(CODE, "solve", [[i]]) for i in range(batch)])
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="git ref whose sandbox is timed alongside")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    results = {"machine": describe(), **sandbox_numbers(args.repeats, 64, args.baseline), **math_numbers()}
    baseline = ""
    if args.baseline:
        old = results["baseline_execution_s_median"]
        baseline = (f"| the same execution with the sandbox of `{args.baseline}` (namespaces + uid, no private root), "
                    f"median | {old * 1000:.0f} ms (new: {results['execution_s_median'] / old:.2f}x) |\n")
    md = f"""## Verifiers (`python benchmarks/verifiers.py --baseline {args.baseline or 'REF'}`)

Machine: {results['machine']}. Isolation mechanism in use: `{results['isolation']}` (PID + network + mount
namespaces via `unshare`, a private tmpfs root with the Python runtime bound read-only, rlimits via
`prlimit`, separate uids for the checker and the candidate per slot).

| measurement | value |
|---|---|
| one sandboxed execution (trivial function, 1 test), median | {results['execution_s_median'] * 1000:.0f} ms |
{baseline}| bare `python -I -S -B -c pass`, median | {results['bare_python_s_median'] * 1000:.0f} ms |
| per-execution sandbox overhead (difference) | {results['overhead_s'] * 1000:.0f} ms |
| MBPP-format execution, 3 asserts, median | {results['mbpp_3_asserts_s_median'] * 1000:.0f} ms |
| stdin/stdout program, 3 runs, median | {results['program_3_runs_s_median'] * 1000:.0f} ms |
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
