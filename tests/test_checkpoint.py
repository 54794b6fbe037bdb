"""Checkpoint files: atomic write, manifest validation, pruning that never loses the newest valid one nor deletes
anything it cannot check; training state restored exactly without unpickling; hostile manifests refused."""

import errno
import hashlib
import json
import os
import random
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from rlvr.store.checkpoint import (
    TRAINING_FILES,
    checkpoint_step,
    is_valid,
    latest_valid,
    load_training_state,
    prune,
    save_training_state,
    write_checkpoint,
)


def _write(root, step, keep_last=5, payload="x"):
    writers = {"a.txt": lambda p: p.write_text(payload), "b.bin": lambda p: p.write_bytes(b"\0" * 10)}
    return write_checkpoint(root, step, writers, keep_last)


def test_written_checkpoint_is_valid_and_complete(tmp_path):
    path = _write(tmp_path, 3)
    assert path.name == "step-00000003" and is_valid(path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3 and set(manifest["files"]) == {"a.txt", "b.bin"}
    assert manifest["files"]["b.bin"]["bytes"] == 10
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["truncate", "modify", "drop_manifest", "drop_file", "bad_manifest"])
def test_damaged_checkpoint_is_invalid_and_skipped(tmp_path, damage):
    good = _write(tmp_path, 1)
    bad = _write(tmp_path, 2)
    if damage == "truncate":
        (bad / "b.bin").write_bytes(b"\0" * 5)
    elif damage == "modify":
        (bad / "a.txt").write_text("y")  # same size, different hash
    elif damage == "drop_manifest":
        (bad / "manifest.json").unlink()
    elif damage == "drop_file":
        (bad / "a.txt").unlink()
    else:
        (bad / "manifest.json").write_text("{not json")
    assert not is_valid(bad)
    assert latest_valid(tmp_path) == good


def test_prune_keeps_last_k_and_never_the_newest_valid(tmp_path):
    for step in range(1, 6):
        _write(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005"]
    (tmp_path / "step-00000005" / "a.txt").write_text("corrupt!")  # newest is now broken
    prune(tmp_path, keep_last=1)
    assert latest_valid(tmp_path).name == "step-00000004"  # the newest valid survives keep_last=1
    assert (tmp_path / "step-00000005").is_dir()  # a newer broken one is kept for inspection, never loaded


def test_stale_temp_dirs_are_removed(tmp_path):
    (tmp_path / ".tmp-step-00000007-999999").mkdir(parents=True)
    _write(tmp_path, 8)
    assert not (tmp_path / ".tmp-step-00000007-999999").exists()


def test_rewriting_an_existing_valid_step_keeps_it(tmp_path):
    first = _write(tmp_path, 4, payload="first")
    again = _write(tmp_path, 4, payload="second")
    assert first == again and (again / "a.txt").read_text() == "first"


# --- hostile and faulty checkpoints ------------------------------------------------------------------------------


def _no_hang(fn, *args):
    """``fn(*args)``, failing the test (instead of hanging the suite) if it blocks on a FIFO or reads a device
    forever; the limit is a watchdog, not a timing assertion."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "blocked reading a FIFO or a device named by the manifest"
    return result[0]


def _relist(path, files):
    """Rewrite ``path``'s manifest to list ``files`` ({name: bytes}) with correct sizes and hashes, as anyone can."""
    entries = {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}
    (path / "manifest.json").write_text(json.dumps({"step": checkpoint_step(path), "files": entries}))


@pytest.mark.parametrize("name", ["../outside.txt", "ABSOLUTE", "sub/a.txt", "/dev/zero", "manifest.json"])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, name):
    root = tmp_path / "checkpoints"
    good = _write(root, 1)
    bad = _write(root, 2)
    (root / "outside.txt").write_text("x")  # what "../outside.txt" reaches, with the hash the manifest claims
    (bad / "sub").mkdir()
    (bad / "sub" / "a.txt").write_text("x")
    if name == "ABSOLUTE":
        name = str(root / "outside.txt")
    _relist(bad, {"a.txt": b"x", name: b"" if name == "/dev/zero" else b"x"})
    assert not _no_hang(is_valid, bad)
    assert latest_valid(root) == good


def test_a_fifo_or_a_symlink_leading_out_is_refused_without_blocking(tmp_path):
    root = tmp_path / "checkpoints"
    good, fifo, link = (_write(root, step) for step in (1, 2, 3))
    (fifo / "a.txt").unlink()
    os.mkfifo(fifo / "a.txt")  # opening it for reading would wait for a writer forever
    _relist(fifo, {"a.txt": b"", "b.bin": b"\0" * 10})
    (tmp_path / "elsewhere.txt").write_text("x")
    (link / "a.txt").unlink()
    (link / "a.txt").symlink_to(tmp_path / "elsewhere.txt")  # same bytes, outside the checkpoint
    assert not _no_hang(is_valid, fifo) and not is_valid(link)
    assert _no_hang(latest_valid, root) == good


@pytest.mark.parametrize("name", ["step-²", "step-1x", "step-", "step-" + "9" * 200, "step-٣"])
def test_directory_names_that_are_not_plain_step_numbers_are_ignored(tmp_path, name):
    """``"²".isdigit()`` is True but ``int("²")`` fails: such names must neither crash nor be taken for steps."""
    (tmp_path / name).mkdir()
    _write(tmp_path, 1, keep_last=1)
    newest = _write(tmp_path, 2, keep_last=1)
    assert latest_valid(tmp_path) == newest
    assert (tmp_path / name).is_dir() and not (tmp_path / "step-00000001").exists()


def test_prune_deletes_nothing_when_checkpoints_cannot_be_read(tmp_path, monkeypatch):
    """An I/O error while validating is not proof that a checkpoint is broken: with every check failing that way,
    pruning must keep all of them (it used to delete every one)."""
    for step in range(1, 4):
        _write(tmp_path, step)

    def failing_read(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(hashlib, "sha256", failing_read)
    prune(tmp_path, keep_last=1)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{s:08d}" for s in range(1, 4)]
    assert latest_valid(tmp_path).name == "step-00000003"


def test_prune_never_deletes_the_checkpoint_it_just_wrote(tmp_path):
    for step in (5, 6, 7):
        _write(tmp_path, step, keep_last=2)
    written = _write(tmp_path, 3, keep_last=2)  # a run resumed from an older checkpoint writes a lower step
    assert written.is_dir() and is_valid(written)
    (written / "a.txt").write_text("!")  # the one just written does not validate (say, the disk lied): keep all
    prune(tmp_path, keep_last=1, written=written)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000006", "step-00000007"]


# --- training state: no pickle, exact restore, old checkpoints --------------------------------------------------


class _Marker:
    """Unpickling this object creates ``path``: what a malicious checkpoint would do with a real payload."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _training_objects(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 3))
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps=2):
    for _ in range(steps):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _draws():
    return random.random(), float(np.random.rand()), np.random.normal(), torch.rand(3).tolist()


def _legacy_writers(model, optimizer, scheduler, step, rng):
    """The files of a checkpoint as rlvr wrote them before (pickles through torch.save)."""
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "weights.safetensors": lambda path: save_file(weights, str(path)),
        "optimizer.pt": lambda path: torch.save(optimizer.state_dict(), path),
        "scheduler.pt": lambda path: torch.save(scheduler.state_dict(), path),
        "rng.pt": lambda path: torch.save(rng, path),
        "state.json": lambda path: path.write_text(json.dumps({"step": step, "cursor": 7})),
        "config.yaml": lambda path: path.write_text("train: {lr: 0.1}\n"),
    }


def _legacy_rng():
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def test_training_state_round_trips_exactly_and_holds_no_pickle(tmp_path):
    model, optimizer, scheduler = _training_objects()
    _train(model, optimizer, scheduler)
    np.random.normal()  # NumPy caches the second Gaussian of a pair: that must survive too
    path = save_training_state(tmp_path, 2, model, optimizer, scheduler, {"cursor": 4}, "a: 1\n", keep_last=2)
    assert sorted(os.listdir(path)) == sorted([*TRAINING_FILES, "manifest.json"])
    for name in os.listdir(path):
        assert not (path / name).read_bytes().startswith(b"\x80"), f"{name} is a pickle"
    expected_draws = _draws()
    _train(model, optimizer, scheduler)  # move on, then restore into fresh objects
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    fresh, fresh_optimizer, fresh_scheduler = _training_objects(seed=1)
    assert load_training_state(path, fresh, fresh_optimizer, fresh_scheduler) == {"step": 2, "cursor": 4}
    assert _draws() == expected_draws
    _train(fresh, fresh_optimizer, fresh_scheduler)
    for name, value in fresh.named_parameters():
        assert torch.equal(value, expected[name]), name
    assert fresh_optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()


def test_a_pickled_payload_in_the_rng_state_is_not_executed(tmp_path):
    """A checkpoint's manifest is a checksum anyone can recompute, so a shared checkpoint may carry a pickle that
    runs code when unpickled. Resuming must never run it: in an old-format checkpoint it is refused; in a
    new-format one a planted rng.pt is not even opened."""
    marker = tmp_path / "pwned"
    model, optimizer, scheduler = _training_objects()
    _train(model, optimizer, scheduler)
    evil = {**_legacy_rng(), "extra": _Marker(marker)}
    old = write_checkpoint(tmp_path / "old", 2, _legacy_writers(model, optimizer, scheduler, 2, evil), keep_last=1)
    assert is_valid(old) and not marker.exists()
    with pytest.raises(ValueError, match="never runs code") as err:
        load_training_state(old, *_training_objects())
    assert not marker.exists()
    assert str(tmp_path) not in str(err.value).replace(str(old), "")  # names the checkpoint, quotes nothing else

    new = save_training_state(tmp_path / "new", 2, model, optimizer, scheduler, {}, "", keep_last=1)
    torch.save(evil, new / "rng.pt")
    files = {n: (new / n).read_bytes() for n in os.listdir(new) if n != "manifest.json"}
    _relist(new, files)
    assert is_valid(new)
    load_training_state(new, *_training_objects())
    assert not marker.exists()


def test_an_old_format_checkpoint_still_resumes_exactly(tmp_path):
    model, optimizer, scheduler = _training_objects()
    _train(model, optimizer, scheduler)
    writers = _legacy_writers(model, optimizer, scheduler, 2, _legacy_rng())
    path = write_checkpoint(tmp_path, 2, writers, keep_last=1)
    expected_draws = _draws()
    fresh, fresh_optimizer, fresh_scheduler = _training_objects(seed=1)
    assert load_training_state(path, fresh, fresh_optimizer, fresh_scheduler) == {"step": 2, "cursor": 7}
    assert _draws() == expected_draws
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    for (name, value), saved in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(value, saved), name
    restored, saved = fresh_optimizer.state_dict()["state"][0], optimizer.state_dict()["state"][0]
    assert torch.equal(restored["exp_avg"], saved["exp_avg"]) and torch.equal(restored["step"], saved["step"])


@pytest.mark.parametrize("damage", [
    ("rng.json", lambda rng: {**rng, "torch": rng["torch"][:-2]}),
    ("rng.json", lambda rng: {**rng, "python": {**rng["python"], "state": [-1] * 625}}),
    ("rng.json", lambda rng: [rng]),
    ("optimizer.json", lambda opt: {**opt, "state": {"99": {}}}),
    ("optimizer.json", lambda opt: {**opt, "param_groups": [{**opt["param_groups"][0], "lr": "0.1"}]}),
    ("optimizer.json", lambda opt: {**opt, "state": {"0": {"exp_avg": {"tensor": "missing"}}}}),
    ("scheduler.json", lambda sch: {**sch, "lr_lambdas": [{"__code__": 1}]}),
    ("scheduler.json", lambda sch: {**sch, "last_epoch": "2"}),
    ("state.json", lambda state: {**state, "step": 3}),
], ids=lambda d: d if isinstance(d, str) else "")
def test_malformed_training_state_is_refused_before_anything_changes(tmp_path, damage):
    name, change = damage
    model, optimizer, scheduler = _training_objects()
    _train(model, optimizer, scheduler)
    path = save_training_state(tmp_path, 2, model, optimizer, scheduler, {}, "", keep_last=1)
    (path / name).write_text(json.dumps(change(json.loads((path / name).read_text()))))
    _relist(path, {n: (path / n).read_bytes() for n in TRAINING_FILES})
    fresh, fresh_optimizer, fresh_scheduler = _training_objects(seed=1)
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(ValueError, match="resume from another"):
        load_training_state(path, fresh, fresh_optimizer, fresh_scheduler)
    assert all(torch.equal(p, b) for p, b in zip(fresh.parameters(), before))
    assert fresh_optimizer.state_dict()["state"] == {}
