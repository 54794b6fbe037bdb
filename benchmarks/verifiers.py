"""Sandbox executions/s and per-execution overhead (against an earlier sandbox, side by side); math-verifier
checks/s.

    python benchmarks/verifiers.py [--baseline 0f6006f]   # writes benchmarks/results/verifiers.json + BENCHMARKS.md

``--baseline REF`` times the sandbox of commit REF (exported with ``git archive`` into a temporary directory)
in the same run: 0f6006f is the last one without the private root filesystem (namespaces and uid only).
``--no-publish`` prints the results instead of writing them.
"""

from __future__ import annotations

import argparse
import json
import resource
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
OLD_WORKER = """
import resource, sys, time
from rlvr.verifiers.sandbox import Limits, Sandbox
cpu = lambda: sum(resource.getrusage(w).ru_utime + resource.getrusage(w).ru_stime
                  for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
box = Sandbox(slots=1, limits=Limits(timeout_s=10))
for _ in sys.stdin:
    started, cpu_started = time.perf_counter(), cpu()
    run = box.run({code!r}, "solve", [[1]])
    elapsed, cpu_used = time.perf_counter() - started, cpu() - cpu_started
    assert run.outputs == {{0: "2"}}, run
    print(elapsed, cpu_used, flush=True)
"""


class Baseline:
    """The sandbox of git ``ref`` in a worker process, timed one execution at a time, so that its runs
    interleave with the current sandbox's (a shared machine's load then hits both alike). The tree is
    exported with ``git archive``: nothing in the repository changes."""

    def __init__(self, ref: str) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="rlvr-baseline-")
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "rlvr"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", self._dir.name], input=archive.stdout, check=True)
        self._proc = subprocess.Popen([sys.executable, "-c", OLD_WORKER.format(code=CODE)], cwd=self._dir.name,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def seconds(self) -> tuple[float, float]:
        self._proc.stdin.write("\n")
        self._proc.stdin.flush()
        wall, cpu = self._proc.stdout.readline().split()
        return float(wall), float(cpu)

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait()
        self._dir.cleanup()


def cpu_seconds() -> float:
    """CPU time of this process and of every descendant it has reaped (the sandbox's processes included)."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def seconds(fn) -> tuple[float, float]:
    """(wall-clock, CPU) seconds of ``fn()``; CPU time hardly depends on what else the machine runs."""
    started, cpu_started = time.perf_counter(), cpu_seconds()
    fn()
    return time.perf_counter() - started, cpu_seconds() - cpu_started


def sandbox_numbers(repeats: int, batch: int, baseline: str | None) -> dict:
    box = Sandbox(slots=1, limits=Limits(timeout_s=10))
    no_memcg = Sandbox(slots=1, limits=Limits(timeout_s=10), memory_cgroup=False)
    old = Baseline(baseline) if baseline else None
    results = {"isolation": box.mode, "memory_cgroup": box.memory_cgroup}
    bare_cmd = [box.python, "-I", "-S", "-B", "-c", "pass"]
    timings = {
        "execution_s_median": lambda: box.run(CODE, "solve", [[1]]),
        "execution_no_memory_cgroup_s_median": lambda: no_memcg.run(CODE, "solve", [[1]]),
        "bare_python_s_median": lambda: subprocess.run(bare_cmd, check=True),
        "mbpp_3_asserts_s_median": lambda: box.execute(make_job(MBPP_ROW, CODE)),
        "program_3_runs_s_median": lambda: box.execute(make_job(PROGRAM_ROW, PROGRAM)),
    }
    samples = {name: [] for name in timings}
    if old:
        samples["baseline_execution_s_median"] = []
    for _ in range(repeats):  # interleaved: every measurement sees the same load
        for name, fn in timings.items():
            samples[name].append(seconds(fn))
        if old:
            samples["baseline_execution_s_median"].append(old.seconds())
    assert box.run(CODE, "solve", [[1]]).outputs == {0: "2"}
    for name, values in samples.items():
        results[name] = statistics.median(wall for wall, _ in values)
        results[name.replace("_s_median", "_cpu_s_median")] = statistics.median(cpu for _, cpu in values)
    results["overhead_s"] = results["execution_s_median"] - results["bare_python_s_median"]
    if old:
        results["baseline_ref"] = baseline
        old.close()
    box.close()
    no_memcg.close()
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
    parser.add_argument("--no-publish", action="store_true", help="print the results, write nothing")
    args = parser.parse_args()
    results = {"machine": describe(), **sandbox_numbers(args.repeats, 64, args.baseline), **math_numbers()}
    baseline = ""
    if args.baseline:
        old = results["baseline_execution_s_median"]
        old_cpu = results["baseline_execution_cpu_s_median"]
        baseline = (f"| the same execution with the sandbox of `{args.baseline}`, median | {old * 1000:.0f} ms "
                    f"(CPU {old_cpu * 1000:.0f} ms; new: {results['execution_s_median'] / old:.2f}x wall, "
                    f"{results['execution_cpu_s_median'] / old_cpu:.2f}x CPU) |\n")
    md = f"""## Verifiers (`python benchmarks/verifiers.py --baseline {args.baseline or 'REF'}`)

Machine: {results['machine']}. Isolation mechanism in use: `{results['isolation']}` (PID, network, mount,
IPC, UTS and cgroup namespaces via `unshare`, a private tmpfs root with the Python runtime bound read-only,
rlimits via `prlimit`, a seccomp filter, separate uids for the checker and the candidate per slot). Memory
cgroup: {results['memory_cgroup']}.

| measurement | value |
|---|---|
| one sandboxed execution (trivial function, 1 test), median | {results['execution_s_median'] * 1000:.0f} ms \
(CPU {results['execution_cpu_s_median'] * 1000:.0f} ms) |
| the same without the memory cgroup, median | {results['execution_no_memory_cgroup_s_median'] * 1000:.0f} ms \
(CPU {results['execution_no_memory_cgroup_cpu_s_median'] * 1000:.0f} ms) |
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
    if args.no_publish:
        print(json.dumps(results, indent=2))
    else:
        publish("verifiers", results, md)
    print(md)


if __name__ == "__main__":
    main()
