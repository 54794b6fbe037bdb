"""Curves and a table for the word-problem transfer runs: held-out accuracy on the generator's held-out split
(eval/accuracy) and on the independently written set (eval/extra_accuracy), run by run.

    python benchmarks/reasoning_transfer.py LABEL=RUN_DIR [LABEL=RUN_DIR ...] --out docs/reasoning_transfer

writes OUT.png (both curves of every run) and benchmarks/results/reasoning_transfer.md (before, after, gain and
minutes per run). Each RUN_DIR is a
finished `rlvr train` run whose config set eval.extra_path (examples/data/word_problems_independent.jsonl).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from rlvr.store.metrics import ACCURACY, EXTRA_ACCURACY, read_metrics


def summarise(label: str, run: Path) -> dict:
    records = read_metrics(run / "metrics.jsonl")
    evals = [(r["step"], 100 * r[ACCURACY], 100 * r.get(EXTRA_ACCURACY, float("nan"))) for r in records
             if ACCURACY in r]
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    return {"label": label, "evals": evals, "minutes": summary.get("wall_time_s", float("nan")) / 60,
            "steps": max(r["step"] for r in records)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    parser.add_argument("--out", default="docs/reasoning_transfer")
    args = parser.parse_args()
    runs = [summarise(label, Path(run)) for label, run in (spec.split("=", 1) for spec in args.runs)]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True, layout="constrained")
    for i, run in enumerate(runs):
        steps = [e[0] for e in run["evals"]]
        color = plt.cm.tab20(i % 20)  # (ten colours repeat after ten runs)
        axes[0].plot(steps, [e[1] for e in run["evals"]], "o-", color=color, label=run["label"])
        axes[1].plot(steps, [e[2] for e in run["evals"]], "s--", color=color, label=run["label"])
    axes[0].set_title("generator's held-out split (its grammar's: settings, phrasings or stories)")
    axes[1].set_title("independently written set (150 problems)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("greedy accuracy (%)")
    axes[1].legend(fontsize=8, loc="upper left")
    fig.suptitle("word problems, LoRA, GRPO (DAPO) on 2 CPU cores", fontsize=10)
    out = ROOT / args.out
    fig.savefig(out.with_suffix(".png"), dpi=110)

    lines = [f"Machine: {describe()}. Command: `python benchmarks/reasoning_transfer.py {' '.join(args.runs)}`.", "",
             "| run | steps | minutes | held-out split | independent set |", "|---|---|---|---|---|"]
    for run in runs:
        (_, g0, i0), (_, g1, i1) = run["evals"][0], run["evals"][-1]
        lines.append(f"| {run['label']} | {run['steps']} | {run['minutes']:.1f} | {g0:.0f} → {g1:.0f} % "
                     f"({g1 - g0:+.0f}) | {i0:.0f} → {i1:.0f} % ({i1 - i0:+.0f}) |")
    (ROOT / "benchmarks" / "results" / "reasoning_transfer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
