"""Checkpoint files: atomic write, manifest validation, pruning that never loses the newest valid one."""

import json

import pytest

from rlvr.checkpoint import is_valid, latest_valid, prune, write_checkpoint


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
