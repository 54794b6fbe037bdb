"""The adapter bucket: versioned LoRA adapters that a learner publishes and rollout servers load.

Layout under the bucket URL (a local directory, or any fsspec URL: ``s3://``, ``gs://``, ``hf://``, ...)::

    v00000012/adapter_model.safetensors   the payload: loadable by peft and by vLLM
    v00000012/adapter_config.json
    v00000012/manifest.json               written last: version, each file's size and SHA-256

A version exists for readers only once its manifest does, and a reader checks every file against it, so a
reader during a publish sees version v-1 or v, never a torn v (on a local disk the manifest itself is
written to a temporary name and renamed; on object stores one PUT is atomic). Old versions are removed
with ``gc``. On S3 (the ``s3`` extra: s3fs) the store's address and keys are the AWS SDK's own settings
(``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ...; docs/concepts/diloco.md), and s3fs and botocore retry a
throttled (503 SlowDown) or dropped request with backoff.

What a reader trusts: nothing in a version. The manifest is a checksum anyone can recompute, so it guards
against torn and damaged versions, not against whoever can write to the bucket. A manifest may name only the
two payload files (no other name, so no path separator, ``..`` or absolute path reaches a file system call),
each at most ``MAX_BYTES`` long; a file is read only if it is a regular file inside its version directory
(a symlink leading elsewhere, a FIFO or a device is refused, never opened for a blocking read), and never more
bytes than the manifest declares. ``fetch_version`` writes only those two names into its cache, which keeps at
most ``keep`` versions. What it does not check: that the weights are any good — whoever can publish to the
bucket chooses the adapter the servers sample with.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import fsspec

MANIFEST = "manifest.json"
PAYLOAD = ("adapter_model.safetensors", "adapter_config.json")
MAX_BYTES = {"adapter_model.safetensors": 8 << 30, "adapter_config.json": 1 << 20}  # per file, bytes
MAX_MANIFEST_BYTES = 64 << 10
CACHE_KEEP = 4  # versions fetch_version keeps in a cache directory
_VERSION = re.compile(r"v([0-9]{8,18})")  # ASCII digits only: "v²".isdigit() is True, int("²") fails
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CACHED = re.compile(r"([0-9]{8,18})-([0-9a-f]{16})")  # fetch order, then the URL's hash


@dataclass(frozen=True)
class Published:
    version: int
    url: str  # the version's directory: what a server's lora_path points at
    bytes: int  # payload size
    seconds: float  # time to publish


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _protocols(fs) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def _is_local(fs) -> bool:
    return "file" in _protocols(fs) or "local" in _protocols(fs)


def is_object_store(fs) -> bool:
    """S3 and its kin (s3fs): no directories to make, conditional creates (``If-None-Match: *``)."""
    return bool({"s3", "s3a"} & set(_protocols(fs)))


def open_url(url: str):
    """``(filesystem, path)`` for a bucket URL. Elsewhere than on a local disk, listings are never cached: fsspec
    keeps a listing until told otherwise, and a learner polling for a peer's new version through a cached one would
    never see it (another machine's writes do not invalidate this process's cache)."""
    if fsspec.utils.get_protocol(url) in ("file", "local"):
        return fsspec.core.url_to_fs(url)
    return fsspec.core.url_to_fs(url, use_listings_cache=False)


def _error_code(err: BaseException) -> str | None:
    """The store's error code behind an fsspec error (s3fs keeps botocore's ClientError as the cause), if any."""
    response = getattr(err.__cause__, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def keeps_versions(fs, path: str) -> bool:
    """Whether ``path`` lies in an object-store bucket that keeps every version of an object (S3 versioning
    "Enabled"): one GetBucketVersioning request. Any error (no s3:GetBucketVersioning permission, a store that does
    not answer it) and "Suspended" (new writes replace the one "null" version) count as no."""
    if not is_object_store(fs):
        return False
    try:
        return fs.call_s3("get_bucket_versioning", Bucket=fs.split_path(path)[0]).get("Status") == "Enabled"
    except Exception:  # noqa: BLE001 (whatever the store or the client answers: not versioned, as before)
        return False


def version_aware(fs):
    """``fs`` as s3fs's version-aware filesystem (another cached instance, the same options): reads by VersionId."""
    if getattr(fs, "version_aware", False):
        return fs
    return type(fs)(*fs.storage_args, **{**fs.storage_options, "version_aware": True})


def object_version(fs, path: str) -> str | None:
    """The VersionId of the object now at ``path`` on a versioned store (one HEAD; None on a store that keeps none).
    FileNotFoundError when there is no object."""
    version = version_aware(fs).info(path, refresh=True).get("VersionId")
    return version if isinstance(version, str) and version else None


def read_remote(fs, path: str, limit: int, version: str | None = None) -> bytes:
    """At most ``limit`` bytes of the object at ``path`` on a store (not a local disk: ``read_local``), in one ranged
    read: no size asked first and no read-ahead, so an object larger than declared costs ``limit`` bytes on the wire.
    ``version``: that version of the object (an S3 VersionId), whatever has replaced or deleted it since.
    FileNotFoundError when there is no object (a prefix with objects below it is none)."""
    try:
        if version is not None:
            return version_aware(fs).cat_file(path, version_id=version, start=0, end=limit)
        return fs.cat_file(path, start=0, end=limit)
    except OSError as err:
        if _error_code(err) == "InvalidRange":  # S3's answer to a range of an empty object
            return b""
        raise


def create_once(fs, path: str, data: bytes, attempts: int = 5) -> bool:
    """Create ``path`` holding ``data`` on a store (not a local disk: ``write_local``) unless it exists; whether the
    object now holds this call's bytes.

    On S3 (s3fs) one conditional PUT, ``If-None-Match: *``: of two writers the store refuses the second (412
    PreconditionFailed); a write racing another one mid-request (409 ConditionalRequestConflict) is tried again.
    A writer whose PUT was stored but whose answer was lost (a timeout, a 503 after the write: the client retries
    it) is refused by its own object, so a refused writer reads the object back: bytes equal to its own are its own
    (every record rlvr creates once names its writer, or is the same whoever writes it). Elsewhere (fsspec's other
    file systems) a check, then a write: two writers within milliseconds can both pass."""
    if not is_object_store(fs):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if fs.exists(path):
            return False
        fs.pipe_file(path, data)
        return True
    for attempt in range(attempts):
        try:
            fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            break
        except OSError as err:
            code = _error_code(err)
            if code == "PreconditionFailed":  # s3fs maps it to FileExistsError only when the store names the header
                break
            if code != "ConditionalRequestConflict" or attempt == attempts - 1:
                raise
            time.sleep(0.05 * 2 ** attempt)
    try:
        return read_remote(fs, path, len(data) + 1) == data
    except FileNotFoundError:
        return False


def version_of(name: str) -> int | None:
    """The version a directory name ``vNNNNNNNN`` stands for (exactly as ``publish`` names it), else None."""
    match = _VERSION.fullmatch(name)
    return int(match[1]) if match and name == f"v{int(match[1]):08d}" else None


class TornVersionError(RuntimeError):
    """A version's files do not match its manifest (being replaced or damaged)."""


class ManifestError(ValueError):
    """A version that rlvr did not write: a malformed manifest, a name other than the payload's, a file that is
    not a regular file inside its version directory. Publish the version again from the learner."""


def _parse_manifest(raw: bytes, version: int, where: str) -> dict[str, tuple[int, str]]:
    """``{name: (bytes, sha256)}`` for the payload files, or ManifestError (never echoing what it read)."""
    try:
        manifest = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        raise ManifestError(f"{where}: {MANIFEST} is not JSON; publish this version again") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or type(manifest.get("version")) is not int or manifest["version"] != version:
        raise ManifestError(f"{where}: {MANIFEST} is not a manifest of this version; publish it again")
    if set(files) != set(PAYLOAD):
        raise ManifestError(f"{where}: {MANIFEST} must list exactly {' and '.join(PAYLOAD)} (rlvr reads no other "
                            "file of a version); publish it again")
    entries = {}
    for name in PAYLOAD:
        meta = files[name]
        size, digest = (meta.get("bytes"), meta.get("sha256")) if isinstance(meta, dict) else (None, None)
        if type(size) is not int or not 0 <= size <= MAX_BYTES[name] or not (
                isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise ManifestError(f"{where}: {MANIFEST} needs a size of at most {MAX_BYTES[name]} bytes and a SHA-256 "
                                f"for {name}; publish it again")
        entries[name] = (size, digest)
    return entries


def inside(path: str, root: str) -> bool:
    """Whether ``path`` (below ``root``) is where it says: no symlink on the way from ``root`` leads elsewhere.

    The one check every local read, write and delete below a bucket makes, against the *job's* bucket root (a
    version, a learner's directory, ``global/``, ``rounds/``: a link at any level below that root fails it)."""
    relative = os.path.relpath(path, root)
    return relative != ".." and not relative.startswith("../") and (
        os.path.realpath(path) == os.path.normpath(os.path.join(os.path.realpath(root), relative)))


def local_directory(path: str, root: str) -> str:
    """Make the directory ``path`` below ``root`` (the bucket) one level at a time, never through a link: a level
    that exists as a symlink or as anything but a directory is refused (ManifestError) before anything is created
    below it, so no directory is ever made outside the bucket."""
    relative = os.path.relpath(path, root)
    if relative == ".." or relative.startswith("../") or os.path.isabs(relative):
        raise ManifestError(f"{path} is not below the bucket {root}")
    os.makedirs(root, exist_ok=True)  # the bucket itself: the user's choice, links and all
    current = root
    for part in ([] if relative == "." else relative.split(os.sep)):
        current = os.path.join(current, part)
        try:
            os.mkdir(current)
        except FileExistsError:
            pass
        if os.path.islink(current) or not os.path.isdir(current):
            raise ManifestError(f"{current} leads outside the bucket {root} (a symlink) or is not a directory: "
                                "remove it")
    return path


def read_local(directory: str, name: str, limit: int, where: str, root: str) -> bytes:
    """At most ``limit`` bytes of the regular file ``directory/name``; ManifestError for a symlink on the way from
    ``root`` (the bucket) that leads elsewhere, or anything but a regular file (a FIFO would block the reader, a
    device never end)."""
    path = os.path.join(directory, name)
    if not inside(path, root):
        raise ManifestError(f"{where}: {name} leads outside the bucket (a symlink); publish the version again")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)  # FileNotFoundError when missing
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ManifestError(f"{where}: {name} is not a regular file; publish the version again")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(min(info.st_size + 1, limit))  # a file that grows while read is still bounded
    finally:
        os.close(fd)


def write_local(path: str, data: bytes, root: str, exclusive: bool = False) -> bool:
    """Write ``data`` to ``path`` below ``root`` (the bucket) without following a link: a directory on the way that
    leads elsewhere, or a symlink, FIFO or anything but a regular file at ``path``, is refused (ManifestError); the
    data goes to a new file beside it, renamed into place (a reader sees the old file or the new one, never half of
    one). ``exclusive``: only if ``path`` does not exist; returns whether this call wrote it."""
    parent = local_directory(os.path.dirname(path), root)
    if os.path.lexists(path):
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise ManifestError(f"{path} is a symlink or not a regular file, which rlvr never writes: remove it")
        if exclusive:
            return False
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if exclusive:
            try:
                os.link(tmp, path)  # fails if path exists, whatever it is: create-once, complete when it appears
            except FileExistsError:
                return False
            except OSError:  # a file system without hard links: create it exclusively, then write it
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:  # a reader may see it half written: it retries until the timeout
                    f.write(data)
            return True
        os.replace(tmp, path)
        return True
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


class AdapterBucket:
    """Versioned adapters under one URL; safe for one writer and any number of readers."""

    def __init__(self, url: str | Path, within: str | Path | None = None):
        """``within``: the URL of the bucket this one lies in (a job's bucket, for its learners' and shared
        directories); every local read, write and delete is checked against it (``inside``). Default: ``url``."""
        self.url = str(url).rstrip("/")
        self.fs, self.root = open_url(self.url)
        self.local = _is_local(self.fs)
        self.trust = self.root if within is None else fsspec.core.url_to_fs(str(within).rstrip("/"))[1]

    def confined(self, path: str) -> bool:
        """Whether ``path`` may be read or deleted: on a file system, below the trust root with no link on the way
        (``inside``); an object store has no links, and every path rlvr builds is below its bucket."""
        return not self.local or inside(path, self.trust)

    def version_url(self, version: int) -> str:
        return f"{self.url}/v{version:08d}"

    def _path(self, version: int, name: str = "") -> str:
        return f"{self.root}/v{version:08d}" + (f"/{name}" if name else "")

    def publish_files(self, version: int, files: dict[str, bytes]) -> Published:
        """Write ``files`` (exactly the ``PAYLOAD`` names) as ``version``: payload first, manifest last."""
        if set(files) != set(PAYLOAD):
            raise ValueError(f"a version holds exactly {' and '.join(PAYLOAD)}; got {sorted(files)}")
        started = time.perf_counter()
        manifest = json.dumps({"version": version, "created": time.time(),
                               "files": {n: {"bytes": len(d), "sha256": _sha256(d)} for n, d in files.items()}})
        if self.local:  # every file renamed into place, no link followed (write_local)
            old = self._path(version, MANIFEST)
            local_directory(self._path(version), self.trust)
            if os.path.lexists(old):  # republishing (a resumed run): hide the old one first
                if not stat.S_ISREG(os.lstat(old).st_mode):
                    raise ManifestError(f"{old} is a symlink or not a regular file, which rlvr never writes: remove it")
                os.unlink(old)
            for name, data in [*files.items(), (MANIFEST, manifest.encode())]:
                write_local(self._path(version, name), data, self.trust)
        else:
            old = self._path(version, MANIFEST)
            if is_object_store(self.fs):  # S3 deletes a missing key without error: one request, not a HEAD and a LIST
                self.fs.rm_file(old)
            else:
                if self.fs.exists(old):
                    self.fs.rm(old)
                self.fs.makedirs(self._path(version), exist_ok=True)  # S3 has none (it would ask for the bucket)
            for name, data in files.items():
                self.fs.pipe_file(self._path(version, name), data)
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
        if not self.confined(self.root):  # a linked learner-k/, global/ or momentum/: nothing of it is listed
            return []
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        versions = (version_of(entry.rstrip("/").rsplit("/", 1)[-1]) for entry in entries)
        return sorted(v for v in versions if v is not None)

    def versions(self) -> list[int]:
        """Versions whose manifest exists, oldest first (their payload is checked when read)."""
        return [v for v in self._directories() if self.fs.exists(self._path(v, MANIFEST))]

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def _read(self, version: int, name: str, limit: int, object_version: str | None = None) -> bytes:
        """At most ``limit`` bytes of one file of ``version`` (FileNotFoundError when it is missing); on a versioned
        store, ``object_version``: that version of the object (rlvr.store.rounds: a decision pins it)."""
        where = self.version_url(version)
        if self.local:
            return read_local(self._path(version), name, limit, where, self.trust)
        return read_remote(self.fs, self._path(version, name), limit, object_version)

    def read(self, version: int, limits: dict[str, int] | None = None,
             object_versions: dict[str, str] | None = None) -> dict[str, bytes]:
        """Every file of ``version``, checked against its manifest (``TornVersionError`` if any differs,
        ``ManifestError`` if the manifest or a file is not what rlvr writes, ``FileNotFoundError`` if the version
        has no manifest). ``limits``: tighter size bounds for some files (refused before anything is read).
        ``object_versions``: on a versioned store, the object version to read of some files (an S3 VersionId)."""
        where = self.version_url(version)
        raw = self._read(version, MANIFEST, MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: {MANIFEST} is larger than any rlvr writes; publish the version again")
        entries = _parse_manifest(raw, version, where)
        for name, limit in (limits or {}).items():
            if entries[name][0] > limit:
                raise ManifestError(f"{where}: {name} declares {entries[name][0]} bytes, more than the {limit} this "
                                    "reader expects")
        files = {}
        for name, (size, digest) in entries.items():
            try:
                data = self._read(version, name, size + 1, (object_versions or {}).get(name))
            except FileNotFoundError:
                raise TornVersionError(f"{where}: {name} is missing") from None
            if len(data) != size or _sha256(data) != digest:
                raise TornVersionError(f"{where}: {name} does not match its manifest")
            files[name] = data
        return files

    def gc(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` complete versions, and unfinished ones older than the newest
        complete version (a publish that crashed); returns the versions removed."""
        complete = self.versions()
        kept = set(complete[-keep:]) if keep > 0 else set()
        newest = complete[-1] if complete else -1
        doomed = [v for v in self._directories() if v not in kept and v <= newest]
        doomed = [v for v in doomed if self.confined(self._path(v))]  # never through a link (rm follows them)
        for version in doomed:
            self.fs.rm(self._path(version), recursive=True)
        return doomed


def _cached(cache_dir: Path) -> list[tuple[int, str, Path]]:
    """(fetch order, URL hash, directory) of every version in ``cache_dir``, oldest fetch first."""
    if not cache_dir.is_dir():
        return []
    entries = ((_CACHED.fullmatch(p.name), p) for p in cache_dir.iterdir())
    return sorted((int(m[1]), m[2], p) for m, p in entries if m)


def evict_version(url: str, cache_dir: Path) -> bool:
    """Forget ``fetch_version``'s copy of ``url`` (say, once its adapter is unloaded); True if there was one."""
    key = _sha256(url.rstrip("/").encode())[:16]
    found = [path for _, k, path in _cached(Path(cache_dir)) if k == key]
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return bool(found)


def fetch_version(url: str, cache_dir: Path, keep: int = CACHE_KEEP) -> Path:
    """A local, verified copy of one published version (``.../vNNNNNNNN``); local directories with a manifest
    are verified in place, other URLs are downloaded into ``cache_dir``, which then holds the ``keep`` versions
    fetched last (older copies are deleted: a server has read an adapter's files once it is loaded; one fetcher
    per cache directory). Directories without a manifest (a plain peft save) are used as they are."""
    url = url.rstrip("/")
    bucket_url, _, leaf = url.rpartition("/")
    fs, path = open_url(url)
    is_local = _is_local(fs)
    if not fs.exists(f"{path}/{MANIFEST}"):
        if is_local:
            if not Path(path).is_dir():
                raise FileNotFoundError(f"{path} is not a directory")
            return Path(path)
        raise FileNotFoundError(f"{url} has no {MANIFEST}: not a published version")
    version = version_of(leaf)
    if version is None:
        raise FileNotFoundError(f"{url}: a published version's directory is named vNNNNNNNN")
    files = AdapterBucket(bucket_url).read(version)  # exactly the PAYLOAD names, each checked
    if is_local:
        return Path(path)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = _cached(cache_dir)
    key = _sha256(url.encode())[:16]
    target = cache_dir / f"{cached[-1][0] + 1 if cached else 0:08d}-{key}"
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".fetch-"))
    try:
        for name in PAYLOAD:
            (tmp / name).write_bytes(files[name])
        evict_version(url, cache_dir)  # an earlier copy of the same URL
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, _, old in _cached(cache_dir)[:-max(keep, 1)]:
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target
