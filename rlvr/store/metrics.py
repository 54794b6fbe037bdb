"""Metric sinks: metrics.jsonl (one object per step), samples.jsonl, the trackers (TensorBoard, wandb, trackio:
rlvr/store/trackers.py), and a PNG of the run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlvr.platform.numbers import is_finite_float32
from rlvr.store.trackers import TrackedRun, open_trackers

REWARD = "rollout/reward_mean"  # the names a run's plot and progress bar read
ACCURACY = "eval/accuracy"
EXTRA_ACCURACY = "eval/extra_accuracy"  # eval.extra_path's held-out set
TOOL_USE = "episode/tool_use_frac"


def namespaced(sections: dict[str, dict[str, float]]) -> dict[str, float]:
    """One metrics row from what each part of a step reports: ``{"update": {"loss": x}}`` -> ``{"update/loss": x}``.
    Every key carries its section, so no part can overwrite another's value (a repeated key is an error)."""
    row: dict[str, float] = {}
    for section, values in sections.items():
        for key, value in values.items():
            name = f"{section}/{key}"
            if name in row:
                raise KeyError(f"metric {name} reported twice")
            row[name] = value
    return row


def _records(path: Path, warn: bool = False) -> list[tuple[str, dict]]:
    """(line, record) for each record of a JSONL log. A last line without its newline that does not parse was cut
    short by a kill mid-write (or is being written): it is skipped, with a warning if ``warn``. Any other line that
    is not a record with an integer step is an error that names it."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if type(record.get("step")) is not int:
                raise TypeError("no integer step")
        except (ValueError, TypeError, AttributeError) as err:
            if number == len(lines) and not line.endswith("\n"):
                if warn:
                    print(f"rlvr: {path}: dropped its last line, cut short when the run was killed while writing it")
                continue
            raise ValueError(f"{path}, line {number}: not a record with a step ({type(err).__name__}: {err}); "
                             "fix or delete that line, then resume again") from None
        records.append((line if line.endswith("\n") else line + "\n", record))
    return records


def _truncate_after(path: Path, step: int) -> None:
    """Drop records of steps after ``step`` (they are redone on resume), and a torn last line; atomic rewrite."""
    if not path.is_file():
        return
    kept = [line for line, record in _records(path, warn=True) if record["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _last_step(path: Path) -> int | None:
    return max((r["step"] for r in read_metrics(path)), default=None) if path.is_file() else None


class MetricsWriter:
    """Appends one JSON object per step and hands its finite scalars to the trackers, same names and steps; on resume,
    first forgets the steps after the checkpoint. ``config`` (the resolved run config) goes to wandb and trackio."""

    def __init__(self, run_dir: Path, trackers: tuple[str, ...] = ("tensorboard",), samples: bool = True,
                 resume_step: int | None = None, project: str = "rlvr", run_name: str = "", config: dict | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        last_logged = None
        if resume_step is not None:
            last_logged = _last_step(self.path)  # what the trackers were sent before the interruption
            _truncate_after(self.path, resume_step)
            _truncate_after(self.samples_path, resume_step)
        run = TrackedRun(run_dir, project, run_name or run_dir.resolve().name, config or {}, resume_step, last_logged)
        self.trackers = open_trackers(trackers, run)
        self._file = self.path.open("a", encoding="utf-8")
        self._samples = self.samples_path.open("a", encoding="utf-8") if samples else None

    def log_samples(self, step: int, samples: list[dict]) -> None:
        if self._samples is not None:
            self._samples.write("".join(json.dumps({"step": step, **s}) + "\n" for s in samples))
            self._samples.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in metrics.items() if is_finite_float32(v)}
        for tracker in self.trackers:
            tracker.log(step, scalars)

    def __enter__(self) -> MetricsWriter:  # noqa: PYI034 (typing.Self needs Python 3.11)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leaving a ``with`` block closes; an exception marks the trackers' runs failed."""
        self.close(failed=exc_type is not None)

    def close(self, failed: bool = False) -> None:
        """Close the files and finish every tracker's run (``failed``: the run ended with an error); a second call
        does nothing."""
        if self._file.closed:
            return
        self._file.close()
        if self._samples is not None:
            self._samples.close()
        for tracker in self.trackers:
            tracker.close(failed)


def read_metrics(path: Path) -> list[dict]:
    """Every record of a JSONL log (a torn last line skipped; see ``_records``)."""
    return [record for _, record in _records(path)]


def plot_run(metrics_path: Path, png_path: Path, title: str = ""):
    """Reward (per step), the fraction of episodes calling a tool (episode runs) and held-out accuracy (where
    evaluated) against step. The legend sits below the axes, so
    it never covers a point. Returns the figure (closed; for inspection)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4.4), layout="constrained")
    steps = [r["step"] for r in records if REWARD in r]
    ax.plot(steps, [r[REWARD] for r in records if REWARD in r], label="train reward (mean)", alpha=0.6)
    tool_use = [(r["step"], r[TOOL_USE]) for r in records if TOOL_USE in r]
    if tool_use:  # episodes: the fraction that called a tool
        ax.plot(*zip(*tool_use), label="episodes calling a tool", color="C2", alpha=0.7)
    evals = [(r["step"], r[ACCURACY]) for r in records if ACCURACY in r]
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out accuracy (greedy)", color="C3")
    extra = [(r["step"], r[EXTRA_ACCURACY]) for r in records if EXTRA_ACCURACY in r]
    if extra:
        ax.plot(*zip(*extra), "s--", label="eval.extra_path accuracy (greedy)", color="C4")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    fig.legend(loc="outside lower center", ncols=2, frameon=False)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return fig
