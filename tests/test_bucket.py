"""The adapter bucket: versions appear whole or not at all, old ones are collected, fsspec URLs work, and a
published adapter loads in peft with the trainer's exact weights."""

import hashlib
import os
import threading

import pytest
import torch

from rlvr.bucket import AdapterBucket, TornVersionError, fetch_version
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
