"""Crash-safe checkpoints that load without running code.

A checkpoint is a directory ``checkpoints/step-00000012/`` written as ``.tmp-step-00000012-<pid>/``: every
file is written and fsynced, then ``manifest.json`` (each file's size and SHA-256) is written last, the
directory is fsynced and renamed into place, and the parent is fsynced. A checkpoint counts only if its
manifest is present and every file matches it, so a crash at any point leaves either the previous valid
checkpoint or the new one — never a half-written one that loads. Pruning keeps the newest ``keep_last``
valid checkpoints, never deletes the newest valid one nor the one just written, and deletes nothing when a
checkpoint cannot be read (an I/O error is not proof that it is broken).

A training checkpoint holds ``weights.safetensors``, ``optimizer.safetensors`` + ``optimizer.json`` (state
tensors, and everything else as JSON), ``scheduler.json``, ``rng.json`` (Python's, NumPy's and torch's
generator states as numbers), ``state.json`` (loop state) and ``config.yaml``. Nothing is pickled, so loading
one never runs code. What a checkpoint is trusted with: the manifest is a checksum anyone can recompute, so it
guards against crashes and damage, not against whoever wrote the directory. A manifest may name only plain
file names (no separator, no ``..``, nothing absolute); a file is read only if it is a regular file inside the
checkpoint (not a symlink leading out, a FIFO or a device) and never beyond its declared size; the optimizer,
scheduler and generator states are checked against the shapes of the live objects (state.json only for its
step) before anything is restored. A malicious checkpoint can still choose the weights, optimizer moments,
learning-rate state, random seeds and data cursor the run continues from — and so what it trains — but it
cannot run code, make rlvr read or write files outside it, or block loading on a FIFO or a device.

Checkpoints written before this format (``optimizer.pt``, ``scheduler.pt``, ``rng.pt``) still load, through
``torch.load(weights_only=True)`` — torch's restricted unpickler, which builds only tensors, containers and
numbers (plus the NumPy array of NumPy's generator key) and refuses anything else — and the run's next
checkpoint is written in the new format.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from rlvr.platform.faults import fault_point
from rlvr.platform.numbers import is_finite_float32

MANIFEST = "manifest.json"
PREFIX = "step-"
MAX_MANIFEST_BYTES = 1 << 20
MAX_TEXT_BYTES = 64 << 20  # state.json, optimizer.json, scheduler.json, rng.json, config.yaml
_STEP = re.compile(r"step-([0-9]{1,18})")  # ASCII digits only: "²".isdigit() is True but int("²") fails
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # a plain name: no separator, not "." or ".."
_SHA256 = re.compile(r"[0-9a-f]{64}")
TRAINING_FILES = ("weights.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json", "rng.json",
                  "state.json", "config.yaml")
REFERENCE_FILE = "reference.safetensors"  # only when the reference policy was refreshed (algo.ref_sync_steps)
LEGACY_FILES = ("weights.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "state.json", "config.yaml")


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


def _open_inside(directory: Path, name: str) -> tuple[int, int]:
    """(descriptor, size) of the regular file ``directory/name``; ValueError for a symlink leading out of
    ``directory`` or anything but a regular file (a FIFO would block the reader, ``/dev/zero`` never end)."""
    real = os.path.realpath(directory / name)
    if os.path.dirname(real) != os.path.realpath(directory):
        raise ValueError(f"{directory}: {name} leads outside the checkpoint")
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{directory}: {name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def _hash_inside(directory: Path, name: str, size: int) -> str | None:
    """SHA-256 of ``directory/name`` if it is a regular file of exactly ``size`` bytes, else None."""
    fd, actual = _open_inside(directory, name)
    digest, left = hashlib.sha256(), size + 1  # one byte more than declared shows a file that grew
    with os.fdopen(fd, "rb") as f:
        if actual != size:
            return None
        while left > 0 and (block := f.read(min(left, 1 << 20))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest() if left == 1 else None


def read_text(path: Path, name: str, limit: int = MAX_TEXT_BYTES) -> str:
    """A small text file of checkpoint ``path`` (config.yaml, a JSON file), bounded and read only from inside it."""
    fd, size = _open_inside(path, name)
    with os.fdopen(fd, "rb") as f:
        if size > limit:
            raise ValueError(f"{path}: {name} is larger than any rlvr writes ({size} > {limit} bytes)")
        return f.read(limit).decode("utf-8")


def checkpoint_step(path: Path) -> int:
    match = _STEP.fullmatch(path.name)
    if match is None:
        raise ValueError(f"{path.name} is not a checkpoint directory name (step-NNNNNNNN)")
    return int(match[1])


def _manifest(path: Path) -> tuple[int, dict[str, tuple[int, str]]]:
    """(step, {name: (bytes, sha256)}); ValueError for a manifest that rlvr did not write, OSError when unreadable."""
    manifest = json.loads(read_text(path, MANIFEST, MAX_MANIFEST_BYTES))
    files = manifest.get("files") if isinstance(manifest, dict) else None
    step = manifest.get("step") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or type(step) is not int:
        raise ValueError(f"{path}: {MANIFEST} is not a checkpoint manifest")
    entries = {}
    for name, meta in files.items():
        if not _FILE.fullmatch(name) or name == MANIFEST:
            raise ValueError(f"{path}: {MANIFEST} names a file outside the checkpoint")
        size, digest = (meta.get("bytes"), meta.get("sha256")) if isinstance(meta, dict) else (None, None)
        if type(size) is not int or size < 0 or not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise ValueError(f"{path}: {MANIFEST} has no valid size and SHA-256 for {name}")
        entries[name] = (size, digest)
    return step, entries


def _check(path: Path) -> bool | None:
    """True when the manifest exists and every listed file has the recorded size and hash; False when the
    checkpoint is incomplete, damaged or not one rlvr wrote; None when it cannot be read (an I/O error)."""
    try:
        step, files = _manifest(path)
        if step != checkpoint_step(path):
            return False
        return all(_hash_inside(path, name, size) == digest for name, (size, digest) in files.items())
    except OSError as err:
        return False if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP) else None
    except ValueError:  # also JSONDecodeError, UnicodeDecodeError
        return False


def is_valid(path: Path) -> bool:
    """True when the manifest exists and every listed file has the recorded size and hash."""
    return _check(path) is True


def _candidates(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if _STEP.fullmatch(p.name) and p.is_dir()]
    return sorted(dirs, key=checkpoint_step, reverse=True)


def latest_valid(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    return next((p for p in _candidates(root) if is_valid(p)), None)


def write_checkpoint(root: Path, step: int, writers: dict[str, Callable[[Path], None]], keep_last: int) -> Path:
    """Write one checkpoint atomically; ``writers`` maps file names to functions that write them."""
    bad = [name for name in writers if not _FILE.fullmatch(name) or name == MANIFEST]
    if bad:
        raise ValueError(f"checkpoint file names must be plain names (letters, digits, '._-'), not {bad}")
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
    prune(root, keep_last, written=final)
    return final


def prune(root: Path, keep_last: int, written: Path | None = None) -> None:
    """Keep the newest ``keep_last`` (at least 1) valid checkpoints and ``written`` (the one just written); drop
    older ones, broken ones, stale temps. Deletes nothing when any checkpoint cannot be read or ``written`` does
    not validate: that is a failing disk, not proof that checkpoints are broken."""
    paths = _candidates(root)
    checks = {p: _check(p) for p in paths}
    if None in checks.values() or (written is not None and checks.get(written) is not True):
        return
    valid = [p for p in paths if checks[p]]
    if not valid:
        return
    keep = set(valid[: max(keep_last, 1)]) | {written}
    for path in paths:
        if path in keep:
            continue
        if checkpoint_step(path) > checkpoint_step(valid[0]):
            continue  # newer than the newest valid one yet broken: never loaded, left for inspection
        shutil.rmtree(path, ignore_errors=True)
    for tmp in root.glob(".tmp-*"):
        if not tmp.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(tmp, ignore_errors=True)


# --- what a training checkpoint holds, as tensors and JSON -------------------------------------------------------


def _rng_state() -> dict:
    version, mt, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    return {
        "python": {"version": version, "state": list(mt), "gauss_next": gauss_next},
        "numpy": {"bit_generator": np_state["bit_generator"], "key": np_state["state"]["key"].tolist(),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
        **({"cuda": [t.numpy().tobytes().hex() for t in torch.cuda.get_rng_state_all()]}
           if torch.cuda.is_available() and torch.cuda.is_initialized() else {}),  # dropout draws on the device
    }


def _words(value, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and all(type(x) is int and 0 <= x < 1 << 32 for x in value)


def _number(value) -> bool:
    return type(value) in (int, float) and is_finite_float32(value)  # 10**400: no OverflowError


def _rng_setter(rng) -> Callable[[], None]:
    """Check every generator state in ``rng`` (``_rng_state``'s shape); returns what restores them."""
    py = rng.get("python") if isinstance(rng, dict) else None
    ok = (isinstance(py, dict) and py.get("version") == random.Random.VERSION and _words(py.get("state"), 625)
          and py["state"][-1] <= 624 and (py.get("gauss_next") is None or _number(py.get("gauss_next"))))
    npy = rng.get("numpy") if ok else None
    ok = (isinstance(npy, dict) and npy.get("bit_generator") == "MT19937" and _words(npy.get("key"), 624)
          and type(npy.get("pos")) is int and 0 <= npy["pos"] <= 624 and npy.get("has_gauss") in (0, 1)
          and _number(npy.get("gauss")))
    raw = rng.get("torch") if ok else None
    size = torch.get_rng_state().numel()
    ok = isinstance(raw, str) and len(raw) == 2 * size and re.fullmatch(r"[0-9a-f]*", raw) is not None
    if not ok:
        raise ValueError("the random generator states are not what rlvr writes")
    state = (py["version"], tuple(py["state"]), py.get("gauss_next"))
    np_state = {"bit_generator": "MT19937", "state": {"key": np.array(npy["key"], dtype=np.uint32), "pos": npy["pos"]},
                "has_gauss": npy["has_gauss"], "gauss": float(npy["gauss"])}
    torch_state = torch.frombuffer(bytearray.fromhex(raw), dtype=torch.uint8)
    cuda = _cuda_rng_states(rng.get("cuda"))

    def restore() -> None:
        random.setstate(state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)

    return restore


def _cuda_rng_states(saved) -> list[torch.Tensor]:
    """The CUDA generators' states a checkpoint holds, to restore when this machine has as many CUDA devices (none
    otherwise: a run resumed elsewhere continues with fresh device streams; docs/concepts/devices.md)."""
    if saved is None:
        return []
    if not (isinstance(saved, list) and len(saved) <= 1024 and all(isinstance(x, str) and len(x) <= 1 << 12
                                                                   and re.fullmatch(r"(?:[0-9a-f]{2})*", x)
                                                                   for x in saved)):
        raise ValueError("the random generator states are not what rlvr writes")
    if not torch.cuda.is_available() or torch.cuda.device_count() != len(saved):
        return []
    states = [torch.frombuffer(bytearray.fromhex(x), dtype=torch.uint8) for x in saved]
    if any(s.numel() != t.numel() for s, t in zip(states, torch.cuda.get_rng_state_all())):
        raise ValueError("the CUDA random generator states are not what this torch writes")
    return states


def _split_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], str]:
    """An optimizer state dict as its state tensors (named t0, t1, ...) and everything else as JSON."""
    tensors, state = {}, {}
    for pid, entry in sd["state"].items():
        state[str(pid)] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"t{len(tensors)}"] = _whole(value)
                state[str(pid)][key] = {"tensor": f"t{len(tensors) - 1}"}
            elif value is None or isinstance(value, (bool, int, float)):
                state[str(pid)][key] = {"value": value}
            else:
                raise TypeError(f"optimizer state {key!r} is a {type(value).__name__}; checkpoints hold tensors and "
                                "numbers only")
    return tensors, json.dumps({"param_groups": sd["param_groups"], "state": state})


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor``, whole: a shard of weights sharded across learners (a DTensor, FSDP2) is gathered
    first, which every learner must do in the same order."""
    if isinstance(tensor, DTensor):  # gathered: a new tensor already
        return tensor.full_tensor().detach().to("cpu").contiguous()
    return tensor.detach().to("cpu", copy=True).contiguous()


def _as_held(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole ``tensor`` as ``like`` holds it: this learner's shard when ``like`` is sharded (cut locally, nothing
    is sent), else ``tensor``."""
    if isinstance(like, DTensor):
        return distribute_tensor(tensor.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return tensor


def _shard_optimizer_state(sd: dict, optimizer) -> dict:
    """``sd`` (whole tensors) with the state of sharded parameters cut to this learner's shards."""
    saved = [pid for group in sd["param_groups"] for pid in group["params"]]
    live = [p for group in optimizer.param_groups for p in group["params"]]
    param_of = dict(zip(saved, live))
    state = {pid: {k: _as_held(v, param_of[pid]) if isinstance(v, torch.Tensor) and v.shape == param_of[pid].shape
                   else v for k, v in entry.items()} for pid, entry in sd["state"].items()}
    return {**sd, "state": state}


def _like(value, template) -> bool:
    """``value`` (from JSON) has the shape of ``template`` (the live object's state): same keys, lengths, kinds."""
    if template is None or isinstance(template, (bool, str)):
        return type(value) is type(template)
    if isinstance(template, (int, float)):
        return _number(value)
    if isinstance(template, (list, tuple)):
        return isinstance(value, list) and len(value) == len(template) and all(map(_like, value, template))
    if isinstance(template, dict):
        return isinstance(value, dict) and value.keys() == template.keys() and all(
            _like(value[k], template[k]) for k in template)
    return False


def _optimizer_state(meta, tensors: dict[str, torch.Tensor], optimizer) -> dict:
    """An optimizer state dict from ``optimizer.json`` + its tensors, checked against the live ``optimizer``."""
    live = optimizer.state_dict()["param_groups"]
    groups = meta.get("param_groups") if isinstance(meta, dict) else None
    if not isinstance(groups, list) or len(groups) != len(live):
        raise ValueError("its optimizer has other parameter groups than this run's")
    param_groups, ids = [], set()
    for saved, now in zip(groups, live):
        params = saved.get("params") if isinstance(saved, dict) else None
        if not _words(params, len(now["params"])) or len(set(params)) != len(params) or ids & set(params):
            raise ValueError("its optimizer holds other parameters than this run's")
        ids |= set(params)
        known = {k: v for k, v in saved.items() if k in now and k != "params"}  # unknown keys are dropped
        if not all(_like(v, now[k]) for k, v in known.items()):
            raise ValueError("its optimizer settings are not what rlvr writes")
        known = {k: tuple(v) if isinstance(now[k], tuple) else v for k, v in known.items()}  # JSON has no tuples
        param_groups.append({**known, "params": params})
    state = {}
    saved_state = meta.get("state")
    if not isinstance(saved_state, dict) or len(saved_state) > len(ids):
        raise ValueError("its optimizer state is not what rlvr writes")
    for pid, entry in saved_state.items():
        if not (re.fullmatch(r"[0-9]{1,9}", pid) and int(pid) in ids and isinstance(entry, dict)):
            raise ValueError("its optimizer state names parameters that do not exist")
        state[int(pid)] = {}
        for key, ref in entry.items():
            if isinstance(ref, dict) and ref.keys() == {"tensor"} and ref["tensor"] in tensors:
                state[int(pid)][key] = tensors[ref["tensor"]]
            elif isinstance(ref, dict) and ref.keys() == {"value"} and (ref["value"] is None or _number(ref["value"])
                                                                         or isinstance(ref["value"], bool)):
                state[int(pid)][key] = ref["value"]
            else:
                raise ValueError("its optimizer state is not what rlvr writes")
    return {"state": state, "param_groups": param_groups}


def _scheduler_state(saved, scheduler) -> dict:
    """A scheduler state dict from ``scheduler.json``, checked against the live ``scheduler`` (unknown keys are
    dropped: a scheduler's state is copied into its attributes)."""
    live = scheduler.state_dict()
    known = {k: v for k, v in saved.items() if k in live} if isinstance(saved, dict) else None
    if known is None or not all(_like(v, live[k]) for k, v in known.items()):
        raise ValueError("its scheduler state is not what rlvr writes")
    return known


def _legacy(path: Path, name: str):
    """A file of a checkpoint written before this format, through torch's restricted unpickler (tensors, containers,
    numbers, and NumPy arrays for NumPy's generator key): no code from the file runs."""
    arrays = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]
    try:
        with torch.serialization.safe_globals(arrays):
            return torch.load(path / name, weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 (UnpicklingError and whatever a hostile pickle provokes: all mean "refused")
        raise ValueError(f"{name} holds objects other than tensors and numbers (rlvr never runs code from a "
                         "checkpoint)") from None


def _legacy_optimizer(sd) -> tuple[dict, dict[str, torch.Tensor]]:
    try:
        tensors, meta = _split_optimizer({"state": dict(sd["state"]), "param_groups": list(sd["param_groups"])})
        return json.loads(meta), tensors
    except (KeyError, TypeError, ValueError, AttributeError):  # json.dumps of a tensor-valued setting: TypeError
        raise ValueError("optimizer.pt is not what rlvr wrote") from None


def _legacy_rng(rng) -> dict:
    try:
        version, mt, gauss_next = rng["python"]
        name, key, pos, has_gauss, gauss = rng["numpy"]
        return {"python": {"version": version, "state": list(mt), "gauss_next": gauss_next},
                "numpy": {"bit_generator": name, "key": [int(k) for k in key], "pos": pos, "has_gauss": has_gauss,
                          "gauss": gauss},
                "torch": rng["torch"].numpy().tobytes().hex()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError("rng.pt is not what rlvr wrote") from None


def save_training_state(
    root: Path,
    step: int,
    model,
    optimizer,
    scheduler,
    state: dict,
    config_yaml: str,
    keep_last: int,
    reference: dict[str, torch.Tensor] | None = None,
    write: bool = True,
) -> Path | None:
    """Trainable weights, optimizer, scheduler, every RNG, loop state and config, as one checkpoint; with
    ``reference`` (a refreshed reference policy's tensors), reference.safetensors too. Weights sharded across
    learners are gathered whole: every learner calls this, and only the one with ``write`` writes."""
    weights = {n: _whole(p) for n, p in model.named_parameters() if p.requires_grad}
    optimizer_tensors, optimizer_json = _split_optimizer(optimizer.state_dict())
    scheduler_json = json.dumps(scheduler.state_dict())
    rng_json = json.dumps(_rng_state())
    if not write:
        return None
    writers = {
        "weights.safetensors": lambda path: save_file(weights, str(path)),
        "optimizer.safetensors": lambda path: save_file(optimizer_tensors, str(path)),
        "optimizer.json": lambda path: path.write_text(optimizer_json),
        "scheduler.json": lambda path: path.write_text(scheduler_json),
        "rng.json": lambda path: path.write_text(rng_json),
        "state.json": lambda path: path.write_text(json.dumps({"step": step, **state}, indent=1)),
        "config.yaml": lambda path: path.write_text(config_yaml),
    }
    if reference:
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in reference.items()}  # no device copy
        writers[REFERENCE_FILE] = lambda path: save_file(tensors, str(path))
    return write_checkpoint(root, step, writers, keep_last)


def load_reference(path: Path) -> dict[str, torch.Tensor]:
    """The reference policy's tensors a checkpoint holds (empty when it holds none). Call after
    ``load_training_state``, which checks every file against the manifest."""
    if REFERENCE_FILE not in _manifest(path)[1]:
        return {}
    try:
        return load_file(str(path / REFERENCE_FILE))
    except (OSError, SafetensorError) as err:
        raise ValueError(f"checkpoint {path}: {REFERENCE_FILE} cannot be loaded: {err}; resume from another") from None


def load_training_state(path: Path, model, optimizer, scheduler) -> dict:
    """Restore what ``save_training_state`` wrote (in place) and return the loop state. Everything is read and
    checked before anything is restored; nothing is unpickled (see the module docstring for older checkpoints)."""
    check = _check(path)
    if check is not True:
        why = "cannot be read (an I/O error)" if check is None else f"is incomplete or damaged ({MANIFEST})"
        raise ValueError(f"{path} {why}; resume from another checkpoint")
    step, files = _manifest(path)
    legacy = "rng.json" not in files and "rng.pt" in files
    missing = [n for n in (LEGACY_FILES if legacy else TRAINING_FILES) if n not in files]
    if missing:
        raise ValueError(f"{path} is not a training checkpoint (it lacks {', '.join(missing)}); resume from another")
    try:
        weights = load_file(str(path / "weights.safetensors"))
        if legacy:
            optimizer_sd = _optimizer_state(*_legacy_optimizer(_legacy(path, "optimizer.pt")), optimizer)
            scheduler_sd = _scheduler_state(_legacy(path, "scheduler.pt"), scheduler)
            restore_rng = _rng_setter(_legacy_rng(_legacy(path, "rng.pt")))
        else:
            optimizer_sd = _optimizer_state(json.loads(read_text(path, "optimizer.json")),
                                            load_file(str(path / "optimizer.safetensors")), optimizer)
            scheduler_sd = _scheduler_state(json.loads(read_text(path, "scheduler.json")), scheduler)
            restore_rng = _rng_setter(json.loads(read_text(path, "rng.json")))
        state = json.loads(read_text(path, "state.json"))
    except (ValueError, OSError, SafetensorError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"checkpoint {path} cannot be loaded: {err}; resume from another checkpoint") from None
    if not isinstance(state, dict) or type(state.get("step")) is not int or state["step"] != step:
        raise ValueError(f"checkpoint {path}: state.json is not this checkpoint's loop state; resume from another")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    reshaped = sorted(n for n in set(params) & set(weights) if weights[n].shape != params[n].shape)
    if missing or unexpected or reshaped:
        raise ValueError(
            f"checkpoint {path} does not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]}, other "
            f"shape {reshaped[:3]}): resume with the model and LoRA settings the run was started with"
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(_as_held(tensor, params[name]))
    optimizer.load_state_dict(_shard_optimizer_state(optimizer_sd, optimizer))
    scheduler.load_state_dict(scheduler_sd)
    restore_rng()
    return state
