"""Metric sinks: metrics.jsonl (one object per step), TensorBoard, and a PNG of the run."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(metrics_path: Path, png_path: Path, title: str = "") -> None:
    """Reward (per step) and held-out accuracy (where evaluated) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records if "reward_mean" in r]
    ax.plot(steps, [r["reward_mean"] for r in records if "reward_mean" in r], label="train reward (mean)", alpha=0.6)
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out accuracy (greedy)", color="C3")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
