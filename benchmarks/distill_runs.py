"""The distillation measurement's table and plot from its run directories (examples/distill.yaml vs the demo).

    python benchmarks/distill_runs.py RUNS_DIR [--plot docs/distillation.png]

RUNS_DIR holds teacher/ (the demo, the teacher's adapter), grpo-sS/ (the demo, seed S), alone-sS/ (distillation
alone) and mixed-sS/ (distillation + the verifier), each with metrics.jsonl and summary.json. Prints a markdown table:
held-out accuracy at each evaluated step (mean and range over seeds), the first step each seed reaches 90 % of the
teacher's accuracy, and the seconds per step (the update's and the whole step's).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ARMS = (("grpo", "GRPO alone (the demo)"), ("alone", "distillation alone"), ("mixed", "distillation + verifier"))


def read(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def curve(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}


def mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r and r.get("step", 0) >= 1]
    return statistics.mean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", type=Path)
    parser.add_argument("--plot", type=Path)
    a = parser.parse_args()
    teacher = curve(read(a.runs / "teacher"))
    target = 0.9 * teacher[max(teacher)]
    print(f"teacher (the demo, 20 steps): {teacher[0]:.2f} -> {teacher[max(teacher)]:.2f}; 90 % of it: {target:.3f}\n")
    curves, lines = {}, []
    steps = sorted(teacher)
    head = " | ".join(f"step {s}" for s in steps)
    lines += [f"| arm | {head} | first step >= 90 % of teacher (per seed) | s/step (update) | s/step (all) |",
              "|---" * (len(steps) + 4) + "|"]
    for arm, title in ARMS:
        runs = sorted(p for p in a.runs.glob(f"{arm}-s*") if (p / "summary.json").is_file())  # finished runs
        rows = [read(r) for r in runs]
        curves[arm] = [curve(r) for r in rows]
        cells = []
        for s in steps:
            got = [c[s] for c in curves[arm] if s in c]
            cells.append(f"{statistics.mean(got):.2f} ({min(got):.2f}-{max(got):.2f})" if got else "-")
        reach = [next((s for s in sorted(c) if c[s] >= target), None) for c in curves[arm]]
        update = statistics.mean(mean_of(r, "update/time_s") for r in rows)
        step = statistics.mean(mean_of(r, "time/step_s") for r in rows)
        lines.append(f"| {title} ({len(runs)} seeds) | {' | '.join(cells)} | "
                     f"{', '.join('-' if r is None else str(r) for r in reach)} | {update:.1f} | {step:.1f} |")
    print("\n".join(lines))
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        for (arm, title), color in zip(ARMS, ("tab:gray", "tab:blue", "tab:green")):
            for i, c in enumerate(curves[arm]):
                ax.plot(sorted(c), [c[s] for s in sorted(c)], color=color, alpha=0.8, label=title if i == 0 else None)
        ax.axhline(teacher[max(teacher)], color="black", linestyle=":", label="teacher")
        ax.axhline(target, color="black", linestyle="--", linewidth=0.8, label="90 % of the teacher")
        ax.set_xlabel("step (8 prompts x 8 samples)")
        ax.set_ylabel("greedy held-out accuracy (100 problems)")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"\nwrote {a.plot}")


if __name__ == "__main__":
    main()
