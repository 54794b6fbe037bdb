"""DiLoCo learners against one learner at equal samples, on this machine.

    python benchmarks/diloco.py --steps 32 --inner 1 4 16

examples/diloco.yaml's task (the demo: SmolLM2-135M-Instruct + LoRA r16, 1-digit arithmetic). One learner with 2
torch threads trains `--steps` steps of 8 prompts; two DiLoCo learners (1 thread each, started together, sharing a
bucket in a temporary directory) train `--steps` steps of 4 prompts each on their own shard: the same samples in
all. For each H (diloco.inner_steps): held-out accuracy (learner 0's 100 problems, at the steps eval.every names,
round boundaries for every H given) against samples and wall time, the bytes each learner sent, and what
per-step data parallelism (an all-reduce of the same fp32 adapter every step) would have sent. Last, a learner
killed in its second round: the survivor's accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from benchmarks.report import publish

EXAMPLE = "examples/diloco.yaml"  # --example changes it (the harder task: examples/reasoning.yaml)
COMMON = ["log.progress=false", "log.plot=false", "log.trackers=[]", "log.samples=false", "train.checkpoint_every=0"]


def _command(out: Path, steps: int, eval_every: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rlvr", "train", EXAMPLE, f"output_dir={out}", f"train.steps={steps}",
            f"eval.every={eval_every}", *COMMON, *extra]


def _curve(run: Path, samples_per_step: int) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    elapsed, curve = 0.0, []
    for r in rows:
        elapsed += r.get("time/step_s", 0.0)
        if "eval/accuracy" in r:
            curve.append({"step": r["step"], "samples": r["step"] * samples_per_step, "wall_s": round(elapsed, 1),
                          "accuracy": r["eval/accuracy"], **({"extra": r["eval/extra_accuracy"]}
                                                             if "eval/extra_accuracy" in r else {})})
    return curve


def _last(run: Path, key: str) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next((r[key] for r in reversed(rows) if key in r), 0.0)


def single(tmp: Path, steps: int, eval_every: int) -> dict:
    out = tmp / "single"
    started = time.perf_counter()
    subprocess.run(_command(out, steps, eval_every, "train.threads=2", "train.prompts_per_step=8"), cwd=ROOT,
                   check=True, capture_output=True)
    return {"wall_s": time.perf_counter() - started, "curve": _curve(out, 8 * 8)}


def pair(tmp: Path, steps: int, eval_every: int, inner: int, fault: str = "", extra: tuple[str, ...] = (),
         tag: str = "") -> dict:
    tag = tag or ("-killed" if fault else "")
    bucket, runs = tmp / f"bucket-{inner}{tag}", []
    started = time.perf_counter()
    jobs = []
    for k in range(2):
        out = tmp / f"h{inner}-{k}{tag}"
        runs.append(out)
        env = {**os.environ, **({"RLVR_FAULT": fault} if fault and k == 1 else {})}
        jobs.append(subprocess.Popen(_command(out, steps, eval_every, "train.threads=1", "train.prompts_per_step=4",
                                              f"diloco.learner={k}/2", f"diloco.bucket={bucket}",
                                              f"diloco.inner_steps={inner}", "diloco.round_timeout_s=60", *extra),
                                     cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = [job.communicate()[1] for job in jobs]
    codes = [job.returncode for job in jobs]
    if codes[0] != 0 or (not fault and codes[1] != 0):
        raise RuntimeError(f"DiLoCo learners failed: {codes}: " + " | ".join(e[-1500:] for e in errors))
    sent = _last(runs[0], "update/outer_bytes_sent")
    rounds = _last(runs[0], "update/outer_rounds")
    return {"wall_s": time.perf_counter() - started, "curve": _curve(runs[0], 2 * 4 * 8), "bytes_sent": sent,
            "rounds": rounds, "per_round_bytes": sent / max(rounds, 1), "late": _last(runs[0], "update/outer_late")}


VARIANTS = (("outer Nesterov, lr 0.7, momentum 0.9 (the default)", ()),
            ("plain averaging (outer lr 1, momentum 0)", ("diloco.outer_momentum=0", "diloco.outer_lr=1.0")),
            ("AdamW reset each round", ("diloco.reset_optimizer=true",)),
            ("bf16 deltas", ("diloco.delta_dtype=bf16",)))


def variants_only(steps: int, eval_every: int) -> None:
    """H = 4, two learners: the outer step's settings, the inner AdamW state, the delta dtype; then H = 16 with a
    learner killed in its second round."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for i, (name, extra) in enumerate(VARIANTS):
            runs[name] = pair(Path(tmp), steps, eval_every, 4, extra=extra, tag=f"-v{i}")
            print(name, runs[name], flush=True)
        killed = pair(Path(tmp), steps, eval_every, 16, fault="diloco_delta@2")
        print("killed at H = 16:", killed, flush=True)
    lines = ["## DiLoCo at H = 4: outer step, inner optimizer, delta dtype (benchmarks/diloco.py --variants-only)", "",
             (f"`python benchmarks/diloco.py --variants-only --steps {steps} --inner {eval_every}` on {describe()}: "
              "two learners as in the section above, H = 4, one setting changed at a time."), "",
             "| H = 4, two learners | held-out accuracy at each evaluation | bytes each learner sent |",
             "|---|---|---|"]
    for name, p in runs.items():
        curve = ", ".join(f"{c['accuracy']:.2f} ({c['samples']} samples)" for c in p["curve"])
        lines.append(f"| {name} | {curve} | {p['bytes_sent'] / 2**20:.1f} MiB |")
    accuracy = ", ".join(f"{c['accuracy']:.2f}" for c in killed["curve"])
    samples = ", ".join(str(c["samples"]) for c in killed["curve"])
    lines += ["", (f"H = 16, learner 1 SIGKILLed as its second round ends (its first round's delta counted): learner "
                   f"0's accuracy {accuracy} at {samples} samples (counted as if both ran); the round closed without "
                   "it at the 60 s timeout and learner 0 ran on alone.")]
    markdown = "\n".join(lines)
    print(markdown)
    publish("diloco_variants", {"machine": describe(), "steps": steps, "runs": runs, "killed_h16": killed}, markdown)


SLOW = ("diloco.round_timeout_s=900",)  # 16 steps of 64-token reasoning drift apart by minutes between learners


def harder(steps: int, eval_every: int, inner: list[int]) -> None:
    """--example another task: one learner against two at each H (default outer step) and plain averaging at the
    smallest H; curves with eval.extra_path's accuracy where the example has one."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = {"one learner (2 threads, 8 prompts a step)": single(tmp, steps, eval_every)}
        print(runs, flush=True)
        for h in inner:
            runs[f"2 learners, H = {h}, outer Nesterov 0.7 / 0.9"] = pair(tmp, steps, eval_every, h, extra=SLOW)
            print(h, runs, flush=True)
        h = min(inner)
        runs[f"2 learners, H = {h}, plain averaging"] = pair(tmp, steps, eval_every, h, tag="-avg", extra=(
            "diloco.outer_momentum=0", "diloco.outer_lr=1.0", *SLOW))

    def cell(c: dict) -> str:
        extra = f" / {c['extra']:.3f}" if "extra" in c else ""
        return f"{c['accuracy']:.2f}{extra} ({c['samples']} samples, {c['wall_s']:.0f} s)"
    lines = [f"## DiLoCo on {EXAMPLE} (benchmarks/diloco.py --example)", "",
             (f"`python benchmarks/diloco.py --example {EXAMPLE} --steps {steps} --inner "
              f"{' '.join(map(str, inner))}` on {describe()}: one learner (8 prompts x G a step, 2 threads) against "
              "two DiLoCo learners (4 prompts x G each on their own shard, 1 thread each): the same samples. "
              "Accuracy is held-out (/ eval.extra_path's set where the example has one); wall time is the sum of "
              "learner 0's step times."), "",
             "| run | accuracy at each evaluation | wall (whole run) | bytes each learner sent |", "|---|---|---|---|"]
    for name, r in runs.items():
        sent = f"{r['bytes_sent'] / 2**20:.1f} MiB ({r['rounds']:.0f} rounds)" if "bytes_sent" in r else "0"
        lines.append(f"| {name} | {'; '.join(cell(c) for c in r['curve'])} | {r['wall_s'] / 60:.1f} min | {sent} |")
    markdown = "\n".join(lines)
    print(markdown)
    publish(f"diloco_{Path(EXAMPLE).stem}", {"machine": describe(), "steps": steps, "runs": runs}, markdown)


def main() -> None:
    global EXAMPLE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--inner", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--variants", action="store_true",
                        help="also H = 4 with plain averaging, with the inner AdamW reset each round, with bf16 deltas")
    parser.add_argument("--variants-only", action="store_true", help="only the H = 4 variants (their own section)")
    parser.add_argument("--example", default=EXAMPLE,
                        help="another task's config (one learner, H in --inner, plain averaging at the smallest H)")
    args = parser.parse_args()
    eval_every = max(args.inner)
    if args.example != EXAMPLE:
        EXAMPLE = args.example
        harder(args.steps, eval_every, args.inner)
        return
    if args.variants_only:
        variants_only(args.steps, eval_every)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        one = single(tmp, args.steps, eval_every)
        print("one learner:", one, flush=True)
        pairs = {}
        for h in args.inner:
            pairs[h] = pair(tmp, args.steps, eval_every, h)
            print(f"H={h}:", pairs[h], flush=True)
        killed = pair(tmp, args.steps, eval_every, 4, fault="diloco_delta@2")
        print("killed:", killed, flush=True)
        variants = {}
        if args.variants:
            for i, (name, extra) in enumerate(VARIANTS[1:]):
                variants[name] = pair(tmp, args.steps, eval_every, 4, extra=extra, tag=f"-v{i}")
                print(name, variants[name], flush=True)
    adapter = pairs[args.inner[0]]["per_round_bytes"]
    results = {"machine": describe(), "steps": args.steps, "one": one, "pairs": {str(h): p for h, p in pairs.items()},
               "killed": killed, "variants": variants, "adapter_bytes": adapter}
    final = one["curve"][-1]
    lines = ["## DiLoCo: two learners through a bucket against one learner (benchmarks/diloco.py)", "",
             (f"`python benchmarks/diloco.py --steps {args.steps} --inner {' '.join(map(str, args.inner))}` on "
              f"{results['machine']}: examples/diloco.yaml (SmolLM2-135M-Instruct, LoRA r16, 1-digit arithmetic, "
              "100 held-out problems). One learner: 8 prompts x 8 per step, 2 threads; two DiLoCo learners: 4 prompts "
              "x 8 each per step on their own shard, 1 thread each, started together: the same samples. Outer "
              "Nesterov lr 0.7, momentum 0.9."), "",
             "| | held-out accuracy | samples | wall time | bytes each learner sent | per-step all-reduce would send |",
             "|---|---|---|---|---|---|",
             f"| one learner | {final['accuracy']:.2f} | {final['samples']} | {one['wall_s']:.0f} s | 0 | — |"]
    for h, p in pairs.items():
        end = p["curve"][-1]
        ddp = adapter * args.steps
        lines.append(f"| 2 learners, H = {h} | {end['accuracy']:.2f} | {end['samples']} | {p['wall_s']:.0f} s | "
                     f"{p['bytes_sent'] / 2**20:.1f} MiB ({p['rounds']:.0f} rounds) | {ddp / 2**20:.1f} MiB "
                     f"({ddp / max(p['bytes_sent'], 1):.0f}x) |")
    end = killed["curve"][-1]
    lines += [(f"| 2 learners, H = 4, learner 1 killed in round 2 | {end['accuracy']:.2f} (learner 0) | "
              f"{end['samples']} (counted as if both ran) | {killed['wall_s']:.0f} s | "
              f"{killed['bytes_sent'] / 2**20:.1f} MiB | |")]
    for name, p in variants.items():
        end = p["curve"][-1]
        lines.append(f"| 2 learners, H = 4, {name} | {end['accuracy']:.2f} | {end['samples']} | {p['wall_s']:.0f} s "
                     f"| {p['bytes_sent'] / 2**20:.1f} MiB | |")
    lines += ["",
              "Accuracy against samples (eval.every = the largest H, so every evaluation falls on a round boundary):",
              "", "| samples | one learner | " + " | ".join(f"H = {h}" for h in pairs) + " |",
              "|---|---|" + "---|" * len(pairs)]
    for i, point in enumerate(one["curve"]):
        cells = [f"{p['curve'][i]['accuracy']:.2f} ({p['curve'][i]['wall_s']:.0f} s)" if i < len(p["curve"]) else ""
                 for p in pairs.values()]
        lines.append(f"| {point['samples']} | {point['accuracy']:.2f} ({point['wall_s']:.0f} s) | "
                     + " | ".join(cells) + " |")
    markdown = "\n".join(lines)
    print(markdown)
    publish("diloco", results, markdown)


if __name__ == "__main__":
    main()
