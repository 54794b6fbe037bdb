"""Crash-safe checkpoints.

A checkpoint is a directory ``checkpoints/step-00000012/`` written as ``.tmp-step-00000012-<pid>/``: every
file is written and fsynced, then ``manifest.json`` (each file's size and SHA-256) is written last, the
directory is fsynced and renamed into place, and the parent is fsynced. A checkpoint counts only if its
manifest is present and every file matches it, so a crash at any point leaves either the previous valid
checkpoint or the new one — never a half-written one that loads. Pruning keeps the newest ``keep_last``
valid checkpoints and never deletes the newest valid one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlvr.faults import fault_point

MANIFEST = "manifest.json"
PREFIX = "step-"


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_step(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def is_valid(path: Path) -> bool:
    """True when the manifest exists and every listed file has the recorded size and hash."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for name, meta in manifest["files"].items():
            file = path / name
            if file.stat().st_size != meta["bytes"] or _sha256(file) != meta["sha256"]:
                return False
        return manifest["step"] == checkpoint_step(path)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _candidates(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()]
    return sorted(dirs, key=checkpoint_step, reverse=True)


def latest_valid(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    return next((p for p in _candidates(root) if is_valid(p)), None)


def write_checkpoint(root: Path, step: int, writers: dict[str, Callable[[Path], None]], keep_last: int) -> Path:
    """Write one checkpoint atomically; ``writers`` maps file names to functions that write them."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    if final.is_dir() and is_valid(final):
        return final
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    files = {}
    for name, write in writers.items():
        write(tmp / name)
        _fsync_file(tmp / name)
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
        fault_point("checkpoint_file_written", step)
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"step": step, "files": files}, indent=1))
    _fsync_file(manifest)
    _fsync_dir(tmp)
    if final.exists():  # an invalid leftover of an earlier crash
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    prune(root, keep_last)
    return final


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` (at least 1) valid checkpoints; drop older ones, broken ones, stale temps."""
    paths = _candidates(root)
    valid = [p for p in paths if is_valid(p)]
    keep = set(valid[: max(keep_last, 1)])
    for path in paths:
        if path in keep:
            continue
        if valid and checkpoint_step(path) > checkpoint_step(valid[0]):
            continue  # newer than the newest valid one yet broken: never loaded, left for inspection
        shutil.rmtree(path, ignore_errors=True)
    for tmp in root.glob(".tmp-*"):
        if not tmp.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(tmp, ignore_errors=True)


def save_training_state(
    root: Path,
    step: int,
    model,
    optimizer,
    scheduler,
    state: dict,
    config_yaml: str,
    keep_last: int,
) -> Path:
    """Trainable weights, optimizer, scheduler, every RNG, loop state and config, as one checkpoint."""
    weights = {n: p.detach().contiguous().clone() for n, p in model.named_parameters() if p.requires_grad}
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    writers = {
        "weights.safetensors": lambda path: save_file(weights, str(path)),
        "optimizer.pt": lambda path: torch.save(optimizer.state_dict(), path),
        "scheduler.pt": lambda path: torch.save(scheduler.state_dict(), path),
        "rng.pt": lambda path: torch.save(rng, path),
        "state.json": lambda path: path.write_text(json.dumps({"step": step, **state}, indent=1)),
        "config.yaml": lambda path: path.write_text(config_yaml),
    }
    return write_checkpoint(root, step, writers, keep_last)


def load_training_state(path: Path, model, optimizer, scheduler) -> dict:
    """Restore what ``save_training_state`` wrote (in place) and return the loop state."""
    if not is_valid(path):
        raise ValueError(f"{path} is not a complete checkpoint (missing or mismatching {MANIFEST}); use another one")
    weights = load_file(str(path / "weights.safetensors"))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(weights) != set(params):
        missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
        raise ValueError(
            f"checkpoint {path} does not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]}): "
            "resume with the model and LoRA settings the run was started with"
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=False)  # our own file: python/numpy RNG states are tuples
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return json.loads((path / "state.json").read_text())
