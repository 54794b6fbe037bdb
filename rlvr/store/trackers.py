"""Experiment trackers fed by MetricsWriter beside metrics.jsonl: TensorBoard, Weights & Biases, trackio.

Each gets the same finite scalars under the same names and steps as metrics.jsonl; wandb and trackio also get the
resolved config, once, when they open. wandb runs offline unless WANDB_MODE is set, so it never reaches the network
(``wandb sync`` uploads later); trackio writes a local SQLite database. Neither package is imported unless listed.

Resume: TensorBoard purges the redone steps. wandb reopens the run id kept in ``<run_dir>/wandb_run_id`` (a new
offline segment with the same id, marked as a resume), trackio the run of the same name. Those two cannot
forget steps, so the steps they already hold are not sent again (a deterministic resume redoes them identically).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

TRACKERS = ("tensorboard", "wandb", "trackio")
OPTIONAL = ("wandb", "trackio")  # packages installed by the pip extras of the same names


class MissingTrackerError(ValueError):
    """log.trackers names a tracker whose package is not installed."""


def require_trackers(names: tuple[str, ...]) -> None:
    """Fail before anything heavy loads when a tracker's package is missing."""
    for name in names:
        if name in OPTIONAL and importlib.util.find_spec(name) is None:
            raise MissingTrackerError(f"log.trackers includes {name}, but the {name} package is not installed: "
                                      f"pip install 'rlvr[{name}]'")


@dataclass(frozen=True)
class TrackedRun:
    """What the trackers are told about the run."""

    run_dir: Path
    project: str
    name: str
    config: dict
    resume_step: int | None = None  # resuming from this checkpoint step: later steps are logged again
    last_logged: int | None = None  # the last step logged before the run was interrupted

    @property
    def sent_through(self) -> int:
        """Steps up to this one are already held by trackers that cannot forget them."""
        return -1 if self.resume_step is None or self.last_logged is None else self.last_logged


class TensorBoard:
    def __init__(self, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter

        purge = None if run.resume_step is None else run.resume_step + 1
        self._writer = SummaryWriter(log_dir=str(run.run_dir / "tensorboard"), purge_step=purge)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self, failed: bool = False) -> None:
        self._writer.close()


class Wandb:
    """A W&B run in ``<run_dir>/wandb``; offline (and without error reporting) unless WANDB_MODE is set."""

    def __init__(self, run: TrackedRun):
        offline = "WANDB_MODE" not in os.environ
        if offline:  # wandb's error reporting would look up its server's address
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        self._wandb = wandb
        id_path = run.run_dir / "wandb_run_id"
        resuming = run.resume_step is not None and id_path.is_file()
        run_id = id_path.read_text().strip() if resuming else secrets.token_hex(4)
        id_path.write_text(run_id + "\n")
        self._sent_through = run.sent_through if resuming else -1
        self._run = wandb.init(project=run.project, name=run.name, id=run_id, dir=run.run_dir, config=run.config,
                               resume="allow", mode="offline" if offline else None, reinit="create_new")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step > self._sent_through:
            self._run.log(scalars, step=step)

    def close(self, failed: bool = False) -> None:
        if self._run is None:
            return
        self._run.finish(exit_code=1 if failed else 0)  # W&B shows the run as failed or finished
        self._run = None
        from wandb.sdk.wandb_setup import singleton

        if singleton().most_recent_active_run is None:  # no run of the caller's own is open:
            self._wandb.teardown()  # stop the wandb-core service process


class Trackio:
    """A trackio run in ``$TRACKIO_DIR``, by default ``<run_dir>/trackio`` (trackio reads it once per process)."""

    def __init__(self, run: TrackedRun):
        if "trackio" not in sys.modules:
            os.environ.setdefault("TRACKIO_DIR", str(run.run_dir.resolve() / "trackio"))
        import trackio

        self._trackio = trackio
        resuming = run.resume_step is not None and _has_run(trackio, run.project, run.name)
        self._sent_through = run.sent_through if resuming else -1
        self._run = trackio.init(project=run.project, name=run.name, config=run.config, embed=False,
                                 resume="allow" if resuming else "never")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step > self._sent_through:
            self._run.log(scalars, step=step)

    def close(self, failed: bool = False) -> None:  # trackio keeps no run status
        if self._run is None:
            return
        from trackio import context_vars

        if context_vars.current_run.get() is self._run:
            self._trackio.finish()  # also forgets it as trackio's current run (else it is finished again at exit)
        else:
            self._run.finish()
        self._run = None


def _has_run(trackio, project: str, name: str) -> bool:
    try:
        return any(r.name == name for r in trackio.Api().runs(project))
    except ValueError:  # no such project yet
        return False


def open_trackers(names: tuple[str, ...], run: TrackedRun) -> list:
    """The named trackers, opened in order; if one fails, those already open are closed."""
    kinds = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio}
    opened = []
    try:
        for name in names:
            opened.append(kinds[name](run))
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    return opened
