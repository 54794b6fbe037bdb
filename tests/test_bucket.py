"""The adapter bucket: versions appear whole or not at all, old ones are collected, fsspec URLs work, and a
published adapter loads in peft with the trainer's exact weights."""

import hashlib
import json
import os
import threading
import uuid

import pytest
import torch

from rlvr.store.bucket import AdapterBucket, TornVersionError, fetch_version
from tests.conftest import make_model


def test_publish_read_and_versions(tmp_path):
    bucket = AdapterBucket(tmp_path / "b")
    assert bucket.versions() == [] and bucket.latest() is None
    p = bucket.publish_files(3, {"adapter_model.safetensors": b"w" * 100, "adapter_config.json": b"{}"})
    assert p.version == 3 and p.bytes == 102 and p.url == f"{tmp_path / 'b'}/v00000003"
    bucket.publish_files(7, {"adapter_model.safetensors": b"x", "adapter_config.json": b"{}"})
    assert bucket.versions() == [3, 7] and bucket.latest() == 7
    assert bucket.read(3) == {"adapter_model.safetensors": b"w" * 100, "adapter_config.json": b"{}"}


def test_a_version_without_manifest_is_invisible_and_a_damaged_one_is_refused(tmp_path):
    bucket = AdapterBucket(tmp_path)
    bucket.publish_files(1, {"adapter_model.safetensors": b"one", "adapter_config.json": b"{}"})
    (tmp_path / "v00000002").mkdir()  # a publish that crashed before its manifest
    (tmp_path / "v00000002" / "adapter_model.safetensors").write_bytes(b"half")
    assert bucket.versions() == [1] and bucket.latest() == 1
    (tmp_path / "v00000001" / "adapter_model.safetensors").write_bytes(b"two")  # same size, other bytes
    with pytest.raises(TornVersionError, match="does not match its manifest"):
        bucket.read(1)


def test_gc_keeps_the_newest_and_removes_crashed_publishes(tmp_path):
    bucket = AdapterBucket(tmp_path)
    for v in range(1, 6):
        bucket.publish_files(v, {"adapter_model.safetensors": bytes([v]), "adapter_config.json": b"{}"})
    (tmp_path / "v00000003" / "manifest.json").unlink()  # v3 never completed
    (tmp_path / "v00000009").mkdir()  # a publish in progress, newer than everything: left alone
    assert bucket.gc(keep=2) == [1, 2, 3]
    assert bucket.versions() == [4, 5] and (tmp_path / "v00000009").is_dir()


def test_a_reader_during_publishes_sees_whole_versions_only(tmp_path):
    """Readers poll the latest version while a writer publishes 2 MB versions: every read is a complete version
    with the bytes the writer wrote for it."""
    bucket = AdapterBucket(tmp_path)
    written: dict[int, str] = {}
    payloads = {v: os.urandom(2 << 20) for v in range(1, 16)}
    for v, data in payloads.items():
        written[v] = hashlib.sha256(data).hexdigest()
    done = threading.Event()
    seen, errors = set(), []

    def reader():
        reader_bucket = AdapterBucket(tmp_path)
        while not done.is_set():
            v = reader_bucket.latest()
            if v is None:
                continue
            try:
                files = reader_bucket.read(v)
            except Exception as err:  # noqa: BLE001 (recorded and asserted below)
                errors.append(f"v{v}: {err}")
                continue
            if hashlib.sha256(files["adapter_model.safetensors"]).hexdigest() != written[v]:
                errors.append(f"v{v}: wrong bytes")
            seen.add(v)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for v, data in payloads.items():
        bucket.publish_files(v, {"adapter_model.safetensors": data, "adapter_config.json": b"{}"})
    done.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(seen) > 1


def test_fsspec_urls(tmp_path):
    """Any fsspec URL works: an in-memory filesystem here, downloaded and checked on fetch."""
    bucket = AdapterBucket("memory://rlvr-test-bucket")
    bucket.publish_files(1, {"adapter_model.safetensors": b"abc", "adapter_config.json": b"{}"})
    assert bucket.versions() == [1]
    local = fetch_version("memory://rlvr-test-bucket/v00000001", tmp_path / "cache")
    assert (local / "adapter_model.safetensors").read_bytes() == b"abc" and local.is_relative_to(tmp_path)
    file_bucket = AdapterBucket(f"file://{tmp_path / 'f'}")
    file_bucket.publish_files(2, {"adapter_model.safetensors": b"d", "adapter_config.json": b"{}"})
    assert fetch_version(f"{tmp_path / 'f'}/v00000002", tmp_path / "cache") == tmp_path / "f" / "v00000002"
    with pytest.raises(FileNotFoundError, match="not a published version"):
        fetch_version("memory://rlvr-test-bucket/v00000009", tmp_path / "cache")


def test_published_adapter_loads_in_peft_with_the_same_weights(tmp_path, tokenizer):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(make_model(len(tokenizer)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    p = AdapterBucket(tmp_path).publish_adapter(model, 5)
    assert sorted(os.listdir(p.url)) == ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    loaded = PeftModel.from_pretrained(make_model(len(tokenizer)), p.url)
    trained = {n: v for n, v in model.named_parameters() if "lora_" in n}
    for name, value in loaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(value, trained[name])


# --- hostile manifests, FIFOs and devices, the fetch cache -------------------------------------------------------

GOOD = {"adapter_model.safetensors": b"weights", "adapter_config.json": b"{}"}


def _no_hang(fn, *args):
    """``fn(*args)`` (or the exception it raised), failing the test instead of hanging the suite if it blocks on a
    FIFO or reads a device forever; the limit is a watchdog, not a timing assertion."""
    result = []

    def call():
        try:
            result.append(fn(*args))
        except Exception as err:  # noqa: BLE001 (handed back to the test)
            result.append(err)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "blocked reading a FIFO or a device named by the manifest"
    return result[0]


def _entries(files):
    return {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}


def _forge(bucket, version, files):
    """What anyone who can write to the bucket can do: put ``files`` at any key and list them in a manifest with
    correct sizes and hashes."""
    for name, data in files.items():
        bucket.fs.pipe_file(f"{bucket.root}/v{version:08d}/{name}", data)
    manifest = {"version": version, "files": _entries(files)}
    bucket.fs.pipe_file(f"{bucket.root}/v{version:08d}/manifest.json", json.dumps(manifest).encode())


@pytest.mark.parametrize("kind", ["traversal", "absolute"])
def test_a_remote_manifest_naming_a_path_outside_its_version_is_refused_and_nothing_is_written(tmp_path, kind):
    """A manifest is a checksum anyone can recompute. Naming ``../../x`` or ``/abs/x`` used to make the server
    write that file wherever it could when it fetched a remote version into its cache."""
    cache, target = tmp_path / "cache", tmp_path / "escaped"
    name = "../../escaped" if kind == "traversal" else str(target)  # cache/.fetch-XXXX/../../escaped = target
    bucket = AdapterBucket(f"memory://rlvr-evil-{uuid.uuid4().hex}")
    _forge(bucket, 1, {**GOOD, name: b"written by whoever can write to the bucket"})
    with pytest.raises(ValueError, match=r"manifest\.json must list exactly"):
        fetch_version(bucket.version_url(1), cache)
    assert not target.exists() and not cache.exists()


@pytest.mark.parametrize("kind", ["traversal", "absolute"])
def test_a_local_manifest_naming_a_path_outside_its_version_is_refused(tmp_path, kind):
    """In a local bucket the same names made the reader open and hash files outside the bucket."""
    bucket = AdapterBucket(tmp_path / "bucket")
    bucket.publish_files(1, GOOD)
    outside = tmp_path / "bucket" / "outside" if kind == "traversal" else tmp_path / "secret"
    outside.write_bytes(b"secret")
    name = "../outside" if kind == "traversal" else str(outside)
    entries = _entries({**GOOD, name: b"secret"})
    (tmp_path / "bucket" / "v00000001" / "manifest.json").write_text(json.dumps({"version": 1, "files": entries}))
    with pytest.raises(ValueError, match=r"manifest\.json must list exactly"):
        bucket.read(1)
    with pytest.raises(ValueError, match=r"manifest\.json must list exactly"):
        fetch_version(bucket.version_url(1), tmp_path / "cache")
    assert outside.read_bytes() == b"secret" and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("where", ["memory", "local"])
def test_a_manifest_naming_dev_zero_is_refused_without_hanging(tmp_path, where):
    bucket = AdapterBucket(f"memory://rlvr-zero-{uuid.uuid4().hex}" if where == "memory" else tmp_path / "b")
    bucket.publish_files(1, GOOD)
    entries = _entries(GOOD)
    entries["/dev/zero"] = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    bucket.fs.pipe_file(f"{bucket.root}/v00000001/manifest.json",
                        json.dumps({"version": 1, "files": entries}).encode())
    err = _no_hang(fetch_version, bucket.version_url(1), tmp_path / "cache")
    assert isinstance(err, ValueError) and "must list exactly" in str(err)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link", "outside-link"])
def test_a_payload_that_is_not_a_regular_file_inside_its_version_is_refused_without_hanging(tmp_path, kind):
    """The manifest names the right file, but on disk it is a FIFO (opening it would wait for a writer forever),
    a symlink to /dev/zero (whose reading never ends) or a symlink to a file elsewhere with the right bytes."""
    bucket = AdapterBucket(tmp_path / "b")
    bucket.publish_files(1, {**GOOD, "adapter_model.safetensors": b""})
    payload = tmp_path / "b" / "v00000001" / "adapter_model.safetensors"
    payload.unlink()
    if kind == "fifo":
        os.mkfifo(payload)
    elif kind == "dev-zero-link":
        payload.symlink_to("/dev/zero")
    else:
        (tmp_path / "elsewhere").write_bytes(b"")
        payload.symlink_to(tmp_path / "elsewhere")
    err = _no_hang(bucket.read, 1)
    assert isinstance(err, ValueError), err
    assert isinstance(_no_hang(fetch_version, bucket.version_url(1), tmp_path / "cache"), ValueError)


def test_manifests_that_are_not_what_rlvr_writes_are_refused(tmp_path):
    bucket = AdapterBucket(tmp_path)
    bucket.publish_files(1, GOOD)
    manifest = tmp_path / "v00000001" / "manifest.json"
    good = json.loads(manifest.read_text())
    for bad in ([good], {**good, "version": 2}, {**good, "version": True},
                {**good, "files": {**good["files"], "adapter_config.json": {"bytes": 2 << 20, "sha256": "0" * 64}}},
                {**good, "files": {**good["files"], "adapter_config.json": {"bytes": 2, "sha256": "../x"}}}):
        manifest.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"manifest\.json"):
            bucket.read(1)
    manifest.write_bytes(b" " * (1 << 20))  # larger than any manifest: not read whole
    with pytest.raises(ValueError, match="larger than any rlvr writes"):
        bucket.read(1)
    with pytest.raises(ValueError, match="exactly"):
        bucket.publish_files(2, {**GOOD, "../x": b""})


@pytest.mark.parametrize("name", ["v²", "v0000000²", "v1", "vx", "v" + "9" * 200])
def test_directory_names_that_are_not_plain_version_numbers_are_ignored(tmp_path, name):
    """``"²".isdigit()`` is True but ``int("²")`` fails: such names must neither crash nor count as versions."""
    bucket = AdapterBucket(tmp_path)
    (tmp_path / name).mkdir()
    (tmp_path / name / "manifest.json").write_text("{}")
    for v in (1, 2):
        bucket.publish_files(v, GOOD)
    assert bucket.versions() == [1, 2] and bucket.gc(keep=1) == [1]
    assert (tmp_path / name).is_dir()
    with pytest.raises(FileNotFoundError, match="vNNNNNNNN"):
        fetch_version(str(tmp_path / name), tmp_path / "cache")


def test_the_fetch_cache_keeps_the_last_versions_only(tmp_path):
    from rlvr.store.bucket import evict_version

    url = f"memory://rlvr-cache-{uuid.uuid4().hex}"
    bucket, cache = AdapterBucket(url), tmp_path / "cache"
    fetched = []
    for v in range(1, 5):
        bucket.publish_files(v, {**GOOD, "adapter_model.safetensors": bytes([v])})
        fetched.append(fetch_version(bucket.version_url(v), cache, keep=2))
    assert sorted(cache.iterdir()) == fetched[2:]  # the two fetched last
    assert (fetched[3] / "adapter_model.safetensors").read_bytes() == bytes([4])
    again = fetch_version(bucket.version_url(3), cache, keep=2)  # fetched again: one copy, now the newest
    assert sorted(cache.iterdir()) == sorted([fetched[3], again])
    assert evict_version(bucket.version_url(3), cache) and sorted(cache.iterdir()) == [fetched[3]]
    assert not evict_version(bucket.version_url(3), cache)
