"""Metric sinks: metrics.jsonl (one object per step), samples.jsonl, TensorBoard, and a PNG of the run."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _truncate_after(path: Path, step: int) -> None:
    """Drop records of steps after ``step`` (they are redone on resume); atomic rewrite."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class MetricsWriter:
    """Appends one JSON object per step; on resume, first forgets the steps after the checkpoint."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, samples: bool = True, resume_step: int | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        if resume_step is not None:
            _truncate_after(self.path, resume_step)
            _truncate_after(self.samples_path, resume_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._samples = self.samples_path.open("a", encoding="utf-8") if samples else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        if self._samples is not None:
            self._samples.write("".join(json.dumps({"step": step, **s}) + "\n" for s in samples))
            self._samples.flush()

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
        if self._samples is not None:
            self._samples.close()
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
