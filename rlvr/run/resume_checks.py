"""What a resumed run takes from its run directory, checked before training starts: the loop state of the
checkpoint's state.json (``check_loop_state``) and the files the run will write again (``check_run_dir``). A run
directory may come from someone else, so both are untrusted input: a wrong type would stop the run mid-step with a
traceback, a planted link would make the run write outside its directory, and a FIFO would block it."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from rlvr.platform.numbers import is_finite_float32
from rlvr.run.gaming import valid_record

MAX_COUNT = 1 << 53  # counters and positions: above any real run, below float rounding and seed overflow
COUNTERS = ("cursor", "skipped_updates", "consecutive_skips", "dropped_prompts", "curriculum_stage",
            "curriculum_stage_taken")
ACCURACIES = ("eval_accuracy_before", "eval_accuracy")
OWN_LINKS = ("wandb",)  # folders whose tools make links of their own (wandb's latest-run)


class ResumeError(ValueError):
    """A run directory or checkpoint that cannot be resumed: one line naming the file and what to do."""


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_COUNT


def check_loop_state(state: dict, checkpoint: Path) -> dict:
    """``state`` (a checkpoint's state.json without ``step``) when every field rlvr reads is what rlvr writes:
    counters integers in [0, 2^53], ``elapsed_s`` a finite number >= 0, accuracies null or in [0, 1], ``pending``
    distinct counters, ``curriculum_recent`` pass rates in [0, 1]. Fields rlvr does not read are left alone."""
    def refuse(field: str, why: str) -> ResumeError:
        return ResumeError(f"checkpoint {checkpoint}: state.json field {field!r} {why}; resume from another "
                           "checkpoint")

    for field, value in state.items():
        if field in COUNTERS and not _count(value):
            raise refuse(field, f"must be an integer in [0, 2^53], not {_shown(value)}")
        if field in ACCURACIES and value is not None and not _fraction(value):
            raise refuse(field, f"must be null or a number in [0, 1], not {_shown(value)}")
        if field == "elapsed_s" and not (type(value) in (int, float) and is_finite_float32(value) and value >= 0):
            raise refuse(field, f"must be a finite number of seconds >= 0, not {_shown(value)}")
        if field == "pending" and not (isinstance(value, list) and all(_count(v) for v in value)
                                       and len(set(value)) == len(value)):
            raise refuse(field, "must be a list of distinct integers in [0, 2^53]")
        if field == "curriculum_recent" and not (isinstance(value, list) and all(_fraction(v) for v in value)):
            raise refuse(field, "must be a list of pass rates in [0, 1]")
        if field == "eval_first" and not (_numbers_finite(value) and valid_record(value)):
            raise refuse(field, "must be an evaluation record (a step, finite metrics, replies with their scores)")
        if field == "shared_taken" and not (isinstance(value, dict) and len(value) <= 1 << 16 and all(
                isinstance(k, str) and k.isdigit() and len(k) <= 6 and _count(v) for k, v in value.items())):
            raise refuse(field, "must map learner numbers to step counters")
        if field == "gaming" and not (value is None or isinstance(value, dict)):
            raise refuse(field, "must be null or the gaming check's alarm")
    return state


def _fraction(value: Any) -> bool:
    return type(value) in (int, float) and is_finite_float32(value) and 0 <= value <= 1


def _numbers_finite(value: Any, depth: int = 0) -> bool:
    """Every number in a JSON value finite in float32 (a 401-digit integer would raise OverflowError in the
    checks that follow); a JSON value nested deeper than 32 is refused too."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return depth < 32 and all(_numbers_finite(v, depth + 1) for v in value)
    return not isinstance(value, (int, float)) or isinstance(value, bool) or is_finite_float32(value)


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, (list, dict)) else type(value).__name__
    return "".join(c if c.isprintable() else "?" for c in text[:40])


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run directory holding, at its top level or one folder down, a symbolic link (the run would write
    through it, outside the directory: a planted ``metrics.tmp`` or ``adapter/adapter_model.safetensors``) or
    anything but regular files and folders (a FIFO ``metrics.jsonl`` would block the run's reads and writes). rlvr
    makes no links there itself; ``wandb/`` is left to wandb."""
    for entry in _entries(run_dir):
        _check_entry(entry)
        if entry.is_dir(follow_symlinks=False) and entry.name not in OWN_LINKS:
            for inner in _entries(Path(entry.path)):
                _check_entry(inner)


def _entries(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise ResumeError(f"{folder} cannot be read ({err.strerror}); fix its permissions, then resume again") from None


def _check_entry(entry: os.DirEntry) -> None:
    if entry.is_symlink():
        raise ResumeError(f"{entry.path} is a symbolic link; a run directory holds none (resuming would write "
                          "through it, outside the run): remove it, then resume again")
    mode = entry.stat(follow_symlinks=False).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise ResumeError(f"{entry.path} is {kind}, not a regular file (reading it would block the run): remove "
                          "it, then resume again")
