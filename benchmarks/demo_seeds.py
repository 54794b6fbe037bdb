"""Run the demo for several seeds (sequentially: timings stay honest on 2 cores) and summarise them.

    python benchmarks/demo_seeds.py --seeds 0 1 2      # writes docs/demo.png and docs/demo_seeds.md

Runs whose summary.json already exists are reused, not retrained.
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
from rlvr.store.metrics import ACCURACY, REWARD

OLD_NAMES = {"eval_accuracy": ACCURACY, "reward_mean": REWARD}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default="examples/demo.yaml")
    args = parser.parse_args()
    runs = []
    for seed in args.seeds:
        run = ROOT / "runs" / f"demo-seed{seed}"
        if not (run / "summary.json").is_file():
            cmd = [sys.executable, "-m", "rlvr", "train", args.config, f"train.seed={seed}", f"output_dir={run}"]
            subprocess.run(cmd, cwd=ROOT, check=True)
        runs.append((seed, run))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = ["| seed | accuracy before | accuracy after | gain (points) | wall time (min) |", "|---|---|---|---|---|"]
    for seed, run in runs:
        summary = json.loads((run / "summary.json").read_text())
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        records = [{OLD_NAMES.get(k, k): v for k, v in r.items()} for r in records]  # runs from before namespacing
        evals = [(r["step"], 100 * r[ACCURACY]) for r in records if ACCURACY in r]
        ax.plot(*zip(*evals), "o-", label=f"seed {seed}: held-out accuracy")
        train = [(r["step"], 100 * r[REWARD]) for r in records if REWARD in r]
        ax.plot(*zip(*train), alpha=0.3, color=ax.lines[-1].get_color(), label=f"seed {seed}: train reward")
        before, after = 100 * summary["eval_accuracy_before"], 100 * summary["eval_accuracy_after"]
        minutes = summary["wall_time_s"] / 60
        rows.append(f"| {seed} | {before:.0f} % | {after:.0f} % | {after - before:+.0f} | {minutes:.1f} |")
    ax.set(xlabel="step", ylabel="%", ylim=(0, 101), title="SmolLM2-135M-Instruct + LoRA, GRPO, 2 CPU cores")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    (ROOT / "docs").mkdir(exist_ok=True)
    fig.savefig(ROOT / "docs" / "demo.png", dpi=110)
    machine = describe()
    command = f"python benchmarks/demo_seeds.py --seeds {' '.join(map(str, args.seeds))}"
    table = "\n".join(rows) + f"\n\nCommand: `{command}`; machine: {machine}.\n"
    (ROOT / "docs" / "demo_seeds.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
