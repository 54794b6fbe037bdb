"""Two learners against one process, on this machine: the demo step, the bytes all-reduced, the peak memory per rank.

    python benchmarks/learners.py --steps 8

examples/demo.yaml (SmolLM2-135M-Instruct + LoRA r16), per-completion seeds in both runs (so both sample the same
completions): one process with 2 torch threads, and `torchrun --standalone --nproc-per-node 2` with 1 thread per
learner. Medians over steps 2..N of the step, its generation and its update; the gradient bytes each learner sends
per step (update/allreduce_bytes); the peak RSS of the largest process (getrusage of the waited-for descendants),
against `rlvr plan` for the same run (fp32, LoRA r16, micro-batch 32, lean step; 1 and 2 devices). On a 2-core
machine two learners share the same two cores one process uses, so this measures the overhead, not a speed-up.

    python benchmarks/learners.py --full --steps 6

Full fine-tuning of the same model (lr 1e-6): one process against two learners holding whole replicas
(train.shard_weights=false) and two learners sharding weights, gradients and AdamW state (FSDP2, the default), with
`rlvr plan --zero 0` and `--zero 3` beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from benchmarks.report import publish

MEASURE = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")  # KiB of the largest descendant


FULL = ["model.lora=false", "train.lr=1e-6"]


def _run(launcher: list[str], threads: int, steps: int, out: Path, extra: tuple[str, ...] = ()) -> dict:
    args = ["-m", "rlvr", "train", "examples/demo.yaml", f"train.steps={steps}", "task.eval_size=8", "eval.every=0",
            "log.progress=false", "log.plot=false", "log.trackers=[]", "log.samples=false",
            "rollout.per_completion_seeds=true", f"train.threads={threads}", f"output_dir={out}", *extra]
    done = subprocess.run([sys.executable, "-c", MEASURE, *launcher, *args], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:]  # step 1 warms up
    return {"step_s": statistics.median(r["time/step_s"] - r.get("eval/time_s", 0.0) for r in rows),
            "generate_s": statistics.median(r["rollout/time_generate_s"] for r in rows),
            "update_s": statistics.median(r["update/time_s"] for r in rows),
            "allreduce_bytes": rows[-1].get("update/allreduce_bytes", 0),
            "reward": statistics.fmean(r["rollout/reward_mean"] for r in rows),
            "peak_rss_mb": int(done.stdout.split()[-1]) / 1024}


def _plan(devices: int, lora_rank: int = 16, zero: int = 0) -> float:
    from rlvr.config.plan import PlannedRun, plan, resolve_arch

    run = PlannedRun(dtype="fp32", lora_rank=lora_rank, beta=0.04, prompts=8, group=8, prompt_len=48,
                     completion_len=12, micro_batch=32, devices=devices, zero=zero, checkpointing=False)
    return plan(resolve_arch("smollm2-135m-instruct"), run)["total"] / 2**20


def full_fine_tuning(steps: int, torchrun: list[str]) -> None:
    """One process, two replicas, two sharded learners: full fine-tuning's step and peak memory."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, launcher, threads, extra in (("one", [sys.executable], 2, FULL),
                                               ("replicas", torchrun, 1, [*FULL, "train.shard_weights=false"]),
                                               ("sharded", torchrun, 1, FULL)):
            runs[name] = _run(launcher, threads, steps, Path(tmp) / name, tuple(extra))
            print(name, runs[name], flush=True)
    results = {"machine": describe(), "steps": steps, **runs,
               "plan_mb": {"1 device": _plan(1, 0), "2 devices, replicas": _plan(2, 0),
                           "2 devices, ZeRO-3": _plan(2, 0, zero=3)}}
    plan = results["plan_mb"]
    lines = ["## Full fine-tuning: replicas against sharded weights (benchmarks/learners.py --full)", "",
             (f"`python benchmarks/learners.py --full --steps {steps}` on {results['machine']}: examples/demo.yaml "
              "with model.lora=false, lr 1e-6 (SmolLM2-135M-Instruct, every weight trained, a frozen reference copy "
              "for beta 0.04), 8 prompts x 8; one process with 2 threads, two learners with 1 thread each. Medians "
              f"over steps 2..{steps}."), "",
             "| | 1 process | 2 learners, replicas | 2 learners, sharded (FSDP2) |", "|---|---|---|---|"]
    for label, key in (("step (generate + score + update)", "step_s"), ("generation", "generate_s"),
                       ("update", "update_s")):
        lines.append(f"| {label} | " + " | ".join(f"{runs[n][key]:.2f} s" for n in runs) + " |")
    lines += ["| peak RSS of the largest process | " + " | ".join(f"{runs[n]['peak_rss_mb']:.0f} MB" for n in runs)
              + " |",
              (f"| `rlvr plan` per device | {plan['1 device']:.0f} MB | {plan['2 devices, replicas']:.0f} MB | "
               f"{plan['2 devices, ZeRO-3']:.0f} MB (--zero 3) |"),
              ("| gradient bytes each learner sends per step | 0 | "
              f"{runs['replicas']['allreduce_bytes'] / 2**20:.0f} MiB (all-reduce) | "
              f"{runs['sharded']['allreduce_bytes'] / 2**20:.0f} MiB (reduce-scatter inputs) |")]
    markdown = "\n".join(lines)
    print(markdown)
    publish("learners_full", results, markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--full", action="store_true", help="full fine-tuning: replicas against sharded weights")
    args = parser.parse_args()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if args.full:
        full_fine_tuning(args.steps, torchrun)
        return
    with tempfile.TemporaryDirectory() as tmp:
        one = _run([sys.executable], 2, args.steps, Path(tmp) / "one")
        print("one process:", one, flush=True)
        two = _run(torchrun, 1, args.steps, Path(tmp) / "two")
        print("two learners:", two, flush=True)
    results = {"machine": describe(), "steps": args.steps, "one": one, "two": two,
               "plan_mb": {"1 device": _plan(1), "2 devices": _plan(2)}}
    rows = [("step (generate + score + update)", "step_s", "s"), ("generation", "generate_s", "s"),
            ("update", "update_s", "s")]
    lines = ["## Two learners against one process (benchmarks/learners.py)", "",
             (f"`python benchmarks/learners.py --steps {args.steps}` on {results['machine']}: examples/demo.yaml "
              "(SmolLM2-135M-Instruct, LoRA r16, 8 prompts x 8), per-completion seeds in both; one process with 2 "
              "threads against `torchrun --nproc-per-node 2` with 1 thread per learner (the same two cores). "
              f"Medians over steps 2..{args.steps}."), "",
             "| | 1 process x 2 threads | 2 learners x 1 thread | ratio |", "|---|---|---|---|"]
    for label, key, unit in rows:
        lines.append(f"| {label} | {one[key]:.2f} {unit} | {two[key]:.2f} {unit} | {two[key] / one[key]:.2f} |")
    lines += [(f"| peak RSS of the largest process | {one['peak_rss_mb']:.0f} MB | {two['peak_rss_mb']:.0f} MB "
              f"(each learner) | {two['peak_rss_mb'] / one['peak_rss_mb']:.2f} |"),
              (f"| `rlvr plan` (fp32, LoRA r16, micro-batch 32) | {results['plan_mb']['1 device']:.0f} MB | "
              f"{results['plan_mb']['2 devices']:.0f} MB per device | |"), "",
              (f"Gradient bytes each learner sends per step: {two['allreduce_bytes'] / 2**20:.1f} MiB (the fp32 "
              "adapter, once per optimizer step). Mean reward over the steps: "
              f"{one['reward']:.3f} (one process) and {two['reward']:.3f} (two learners).")]
    markdown = "\n".join(lines)
    print(markdown)
    publish("learners", results, markdown)


if __name__ == "__main__":
    main()
