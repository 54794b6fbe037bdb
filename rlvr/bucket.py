"""The adapter bucket: versioned LoRA adapters that a learner publishes and rollout servers load.

Layout under the bucket URL (a local directory, or any fsspec URL: ``s3://``, ``gs://``, ``hf://``, ...)::

    v00000012/adapter_model.safetensors   the payload: loadable by peft and by vLLM
    v00000012/adapter_config.json
    v00000012/manifest.json               written last: version, each file's size and SHA-256

A version exists for readers only once its manifest does, and a reader checks every file against it, so a
reader during a publish sees version v-1 or v, never a torn v (on a local disk the manifest itself is
written to a temporary name and renamed; on object stores one PUT is atomic). Old versions are removed
with ``gc``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import fsspec

MANIFEST = "manifest.json"
PAYLOAD = ("adapter_model.safetensors", "adapter_config.json")


@dataclass(frozen=True)
class Published:
    version: int
    url: str  # the version's directory: what a server's lora_path points at
    bytes: int  # payload size
    seconds: float  # time to publish


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _is_local(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


class TornVersionError(RuntimeError):
    """A version's files do not match its manifest (being replaced or damaged)."""


class AdapterBucket:
    """Versioned adapters under one URL; safe for one writer and any number of readers."""

    def __init__(self, url: str | Path):
        self.url = str(url).rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.local = _is_local(self.fs)

    def version_url(self, version: int) -> str:
        return f"{self.url}/v{version:08d}"

    def _path(self, version: int, name: str = "") -> str:
        return f"{self.root}/v{version:08d}" + (f"/{name}" if name else "")

    def publish_files(self, version: int, files: dict[str, bytes]) -> Published:
        """Write ``files`` as ``version``: payload first, manifest last."""
        started = time.perf_counter()
        if self.fs.exists(self._path(version, MANIFEST)):  # republishing (a resumed run): hide the old one first
            self.fs.rm(self._path(version, MANIFEST))
        self.fs.makedirs(self._path(version), exist_ok=True)
        for name, data in files.items():
            self.fs.pipe_file(self._path(version, name), data)
        manifest = json.dumps({"version": version, "created": time.time(),
                               "files": {n: {"bytes": len(d), "sha256": _sha256(d)} for n, d in files.items()}})
        if self.local:  # a reader must never see a half-written manifest
            tmp = self._path(version, f".{MANIFEST}.{os.getpid()}.tmp")
            self.fs.pipe_file(tmp, manifest.encode())
            os.replace(tmp, self._path(version, MANIFEST))
        else:
            self.fs.pipe_file(self._path(version, MANIFEST), manifest.encode())
        size = sum(len(d) for d in files.values())
        return Published(version, self.version_url(version), size, time.perf_counter() - started)

    def publish_adapter(self, model, version: int) -> Published:
        """Publish a peft model's adapter (its safetensors weights and adapter_config.json) as ``version``."""
        with tempfile.TemporaryDirectory(prefix="rlvr-adapter-") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            files = {name: (Path(tmp) / name).read_bytes() for name in PAYLOAD}
        return self.publish_files(version, files)

    def _directories(self) -> list[int]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]
        return sorted(int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit())

    def versions(self) -> list[int]:
        """Versions whose manifest exists, oldest first (their payload is checked when read)."""
        return [v for v in self._directories() if self.fs.exists(self._path(v, MANIFEST))]

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def read(self, version: int) -> dict[str, bytes]:
        """Every file of ``version``, checked against its manifest (``TornVersionError`` if any differs,
        ``FileNotFoundError`` if the version has no manifest)."""
        manifest = json.loads(self.fs.cat_file(self._path(version, MANIFEST)))
        files = {}
        for name, meta in manifest["files"].items():
            try:
                data = self.fs.cat_file(self._path(version, name))
            except FileNotFoundError:
                raise TornVersionError(f"{self.version_url(version)}: {name} is missing") from None
            if len(data) != meta["bytes"] or _sha256(data) != meta["sha256"]:
                raise TornVersionError(f"{self.version_url(version)}: {name} does not match its manifest")
            files[name] = data
        return files

    def gc(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` complete versions, and unfinished ones older than the newest
        complete version (a publish that crashed); returns the versions removed."""
        complete = self.versions()
        kept = set(complete[-keep:]) if keep > 0 else set()
        newest = complete[-1] if complete else -1
        doomed = [v for v in self._directories() if v not in kept and v <= newest]
        for version in doomed:
            self.fs.rm(self._path(version), recursive=True)
        return doomed


def fetch_version(url: str, cache_dir: Path) -> Path:
    """A local, verified copy of one published version (``.../vNNNNNNNN``); local directories with a manifest
    are verified in place, other URLs are downloaded into ``cache_dir``. Directories without a manifest (a
    plain peft save) are used as they are."""
    url = url.rstrip("/")
    bucket_url, _, leaf = url.rpartition("/")
    fs, path = fsspec.core.url_to_fs(url)
    is_local = _is_local(fs)
    if not fs.exists(f"{path}/{MANIFEST}"):
        if is_local:
            if not Path(path).is_dir():
                raise FileNotFoundError(f"{path} is not a directory")
            return Path(path)
        raise FileNotFoundError(f"{url} has no {MANIFEST}: not a published version")
    if not (leaf.startswith("v") and leaf[1:].isdigit()):
        raise FileNotFoundError(f"{url}: a published version's directory is named vNNNNNNNN")
    files = AdapterBucket(bucket_url).read(int(leaf[1:]))
    if is_local:
        return Path(path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / _sha256(url.encode())[:16]
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".fetch-"))
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target
