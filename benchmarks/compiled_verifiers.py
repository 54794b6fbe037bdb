"""Compile + judge throughput of the compiled-language verifier, per language, on this machine's cores.

    python benchmarks/compiled_verifiers.py [--n 16] [--no-publish]   # benchmarks/results/compiled_verifiers.json
                                                                      # + BENCHMARKS.md's section

For each language, ``n`` distinct correct solutions of one MultiPL-E-style row (the test set's rows, each made
distinct by a comment, so every build misses the cache) are judged in one batch on a 2-slot sandbox pool:
solutions/s on a cache miss; then the same batch again: solutions/s on a cache hit (the build installed, only the
run). Then the misses again while two busy processes load both cores: how many correct solutions a loaded machine
turns into failures (the per-test limit is CPU time, so the answer should be none).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from benchmarks.report import publish
from rlvr.verifiers.compiled import Settings
from rlvr.verifiers.compiled_judge import CompiledJudge, Program
from tests.verifiers.compiled_rows import ROWS, STOPS

COMMENT = {"c": "/* {} */", "cpp": "// {}", "rust": "// {}", "java": "// {}", "javascript": "// {}"}


def batch(lang: str, n: int, tag: str) -> list[Program]:
    _name, prompt, tests, good, _ = ROWS[lang][0]
    return [Program(lang, COMMENT[lang].format(f"{tag} {i}") + "\n" + good, tests, prompt, stop=tuple(STOPS[lang]))
            for i in range(n)]


def timed(judge: CompiledJudge, programs: list[Program]) -> tuple[float, int]:
    start = time.perf_counter()
    verdicts = judge.judge(programs)
    return time.perf_counter() - start, sum(v.outcome != "passed" for v in verdicts)


def spin(stop) -> None:
    while not stop.is_set():
        pass


def measure(n: int) -> dict:
    out = {}
    for lang in ROWS:
        judge = CompiledJudge(Settings(), slots=2)
        timed(judge, batch(lang, 1, "warm"))  # the sandbox's start and the compiler's first run
        miss_s, miss_failed = timed(judge, batch(lang, n, "miss"))
        hit_s, hit_failed = timed(judge, batch(lang, n, "miss"))
        stop = multiprocessing.Event()
        load = [multiprocessing.Process(target=spin, args=(stop,)) for _ in range(2)]
        for p in load:
            p.start()
        try:
            loaded_s, loaded_failed = timed(judge, batch(lang, n, "loaded"))
        finally:
            stop.set()
            for p in load:
                p.join()
        judge.close()
        out[lang] = {"miss_per_s": n / miss_s, "hit_per_s": n / hit_s, "loaded_per_s": n / loaded_s,
                     "failed": {"miss": miss_failed, "hit": hit_failed, "loaded": loaded_failed}}
        print(lang, {k: round(v, 2) if isinstance(v, float) else v for k, v in out[lang].items()}, flush=True)
    return out


def markdown(results: dict, n: int, machine: str) -> str:
    lines = [
        "## Compiled-language verifier throughput (benchmarks/compiled_verifiers.py)",
        "",
        (f"`python benchmarks/compiled_verifiers.py --n {n}` on {machine}: {n} distinct correct solutions of one "
        "MultiPL-E-style row per language (tests/verifiers/compiled_rows.py) judged in one batch on a 2-slot "
        "sandbox pool, each a build (C/C++: the completion's unit, the tests' unit once per row, a link; Rust: the "
        "completion's library crate, then the tests' binary crate) and one run of the assertion program (JavaScript: "
        "a runner that runs the tests in a vm context of their own); "
        "then the same solutions again (every build a cache hit); then new ones "
        "while two busy processes load both cores. The C++ row includes <bits/stdc++.h>, as MultiPL-E's do: "
        "about 1.5 s of -O2 compile a unit (a precompiled header would cut it; not done)."),
        "",
        ("| language | solutions/s, cache miss | cache hit | miss, both cores loaded | correct solutions failed "
        "(miss / hit / loaded) |"),
        "|---|---|---|---|---|",
    ]
    for lang, r in results.items():
        f = r["failed"]
        lines.append(f"| {lang} | {r['miss_per_s']:.2f} | {r['hit_per_s']:.2f} | {r['loaded_per_s']:.2f} | "
                     f"{f['miss']} / {f['hit']} / {f['loaded']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--no-publish", action="store_true")
    args = parser.parse_args()
    results = measure(args.n)
    machine = describe()
    if args.no_publish:
        print(markdown(results, args.n, machine))
        return
    publish("compiled_verifiers", {"n": args.n, "machine": machine, "results": results},
            markdown(results, args.n, machine))


if __name__ == "__main__":
    main()
