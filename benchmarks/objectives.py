"""The demo with each objective: one seed, 20 steps each, run one after another (timings stay honest on 2 cores).

    python benchmarks/objectives.py            # writes docs/objectives.png and the table in docs/concepts/objectives.md

Each run is `rlvr train examples/demo.yaml` with the objective's preset (and the loss term's knob where it is not
an objective); runs whose summary.json already exists are reused, not retrained.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from benchmarks.report import publish
from rlvr.store.metrics import ACCURACY, REWARD

RUNS = {  # name -> overrides of examples/demo.yaml (the presets' knobs written out, so the table shows them)
    "grpo": ["algo.preset=grpo"],
    "dapo": ["algo.preset=dapo"],
    "dr_grpo": ["algo.preset=dr_grpo"],
    "gspo": ["algo.objective=gspo", "algo.eps_low=3e-4", "algo.eps_high=4e-4", "algo.beta=0",
             "algo.aggregation=sequence_mean"],
    "luspo": ["algo.objective=gspo", "algo.eps_low=2e-3", "algo.eps_high=2.5e-3", "algo.beta=0",
              "algo.aggregation=sequence_sum"],
    "cispo": ["algo.objective=cispo", "algo.eps_low=1", "algo.eps_high=4", "algo.beta=0",
              "algo.aggregation=token_mean"],
    "sapo": ["algo.objective=sapo", "algo.beta=0", "algo.aggregation=sequence_mean"],
    "grpo + entropy bonus 0.01": ["algo.preset=grpo", "algo.entropy_coef=0.01"],
    "grpo + top 20 % entropy tokens": ["algo.preset=grpo", "algo.top_entropy_quantile=0.2"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=None, help="run only these names")
    args = parser.parse_args()
    done = []
    for name, overrides in RUNS.items():
        if args.only and name not in args.only:
            continue
        run = ROOT / "runs" / "objectives" / name.replace(" ", "_").replace("%", "pct").replace("+", "and")
        if not (run / "summary.json").is_file():
            cmd = [sys.executable, "-m", "rlvr", "train", "examples/demo.yaml", *overrides, f"train.seed={args.seed}",
                   f"output_dir={run}", "log.progress=false", "log.samples=false"]
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            print(f"{name}: done", flush=True)
        done.append((name, overrides, run))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    header = "| objective | overrides | accuracy before | after | gain | reward, last 5 steps | wall time (min) |"
    rows = [header, "|---|---|---|---|---|---|---|"]
    results = {}
    for name, overrides, run in done:
        summary = json.loads((run / "summary.json").read_text())
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rewards = [(r["step"], r[REWARD]) for r in records if REWARD in r]
        evals = [(r["step"], 100 * r[ACCURACY]) for r in records if ACCURACY in r]
        left.plot(*zip(*rewards), label=name)
        right.plot(*zip(*evals), "o-", label=name)
        before, after = 100 * summary["eval_accuracy_before"], 100 * summary["eval_accuracy_after"]
        last = sum(r for _, r in rewards[-5:]) / len(rewards[-5:])
        minutes = summary["wall_time_s"] / 60
        shown = " ".join(f"`{o}`" for o in overrides)
        rows.append(f"| {name} | {shown} | {before:.0f} % | {after:.0f} % | {after - before:+.0f} | {last:.2f} | "
                    f"{minutes:.1f} |")
        results[name] = {"overrides": overrides, "before": before, "after": after, "reward_last5": last,
                         "minutes": minutes}
    left.set(xlabel="step", ylabel="mean reward (train samples)", ylim=(0, 1.01))
    right.set(xlabel="step", ylabel="greedy held-out accuracy (%)", ylim=(0, 101))
    for ax in (left, right):
        ax.grid(alpha=0.3)
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"examples/demo.yaml (SmolLM2-135M-Instruct + LoRA), one objective per run, seed {args.seed}")
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "objectives.png", dpi=110)
    machine = describe()
    markdown = (f"## Objectives on the demo (seed {args.seed}, 20 steps each)\n\n" + "\n".join(rows) +
                f"\n\nCommand: `python benchmarks/objectives.py`; machine: {machine}.")
    publish("objectives", {"seed": args.seed, "runs": results, "machine": machine}, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
