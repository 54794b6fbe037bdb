"""DiLoCo's exchange: learners that share nothing but a bucket (a local or shared directory, or any fsspec URL).

Layout under ``diloco.bucket``::

    learner-0003/v00000005/   learner 3's delta of round 5 (payload, then manifest.json: rlvr.store.bucket's format)
    job.json                  the job's identity: the settings its learners must share and the SHA-256 of its start
                              weights (created once, exclusively, by the learner that claims the start)
    rounds/00000005.json      round 5's decision: which learners' deltas it averaged (created once, exclusively)
    rounds/00000005-0001.verdict  whether learner 1's pinned delta of round 5 is applied or dropped by every
                              learner (created once, by the first that read it or gave up on it: rlvr.run.diloco)
    global/v00000005/         the shared weights after round 5 (for learners that join or resume)
    momentum/v00000005/       the outer optimizer's momentum after round 5

A version holds ``adapter_model.safetensors`` (the tensors, named as the model names its trainable parameters) and
``adapter_config.json`` (a small JSON record), so every read goes through ``AdapterBucket``'s checks: a manifest
naming exactly those two files, sizes and SHA-256 checked, regular files only, bounded reads.

Who decides a round: whichever learner first finds it closable — every learner's delta arrived, or
``round_timeout_s`` passed since its own delta with at least ``min_learners`` — creates the decision file
exclusively (``O_EXCL`` on a file system; on S3 a conditional PUT, ``If-None-Match: *``, which the store refuses to
the second writer; elsewhere a check then a write, which two learners racing within milliseconds could both pass:
rlvr.store.bucket.create_once). Every learner then applies the decided deltas itself, sorted by learner, so all of
them compute the same weights bit for bit.

What a decision pins: each member's payload by its SHA-256, as the decider read it; on an object store that keeps
every version of an object (S3 versioning "Enabled": asked once per RoundBucket), also by the object version the
decider hashed (``versions``: S3 VersionIds), so a delta replaced or deleted after its round's decision is still
read as the decided bytes. Elsewhere a delta replaced after the decision is unreadable to a learner that had not
read it yet (rlvr.run.diloco: verdicts).

What a reader trusts: nothing. A delta is refused (counted, never applied) unless its names, shapes and dtype are
exactly the model's trainable parameters at the configured delta dtype and every value is finite; a decision is
refused unless it is a small JSON record of learner numbers, digests and (optional) object versions.
``max_delta_norm`` bounds what one learner's delta can do (rlvr.core.outer.bound_norm). What it does not check:
that a delta within those bounds was trained honestly — whoever can write to the bucket takes part in the average.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from rlvr.store.bucket import (
    MANIFEST,
    AdapterBucket,
    ManifestError,
    TornVersionError,
    create_once,
    keeps_versions,
    object_version,
    read_local,
    read_remote,
    write_local,
)

TENSORS, RECORD = "adapter_model.safetensors", "adapter_config.json"
MAX_DECISION_BYTES = 64 << 10
JOB = "job.json"  # what the job's learners must agree on, recorded by the first
DELTA_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # diloco.delta_dtype -> torch
# An object version a decision pins: S3's are 32 URL-safe characters (AWS documents at most 1,024 bytes); an id
# outside this is never pinned (``decide`` leaves the decision without versions) and refused in a decision.
_OBJECT_VERSION = re.compile(r"[A-Za-z0-9._+/=-]{1,256}")


class RefusedDelta(ValueError):
    """A delta (or decision) that is not what a learner of this run writes; never applied."""


class UnreadableDelta(RefusedDelta):
    """A delta whose bytes could not be had (missing, torn, linked out of the bucket, other bytes than a decision
    pins): unlike a delta refused on its bytes, another learner may read it (rlvr.run.diloco: verdicts)."""


@dataclass(frozen=True)
class Decision:
    round: int
    members: tuple[int, ...]  # learners whose deltas the round averages, ascending
    digests: dict[int, str]  # each member's payload SHA-256, as the decider read it
    closed_by: int
    reason: str  # "all" | "timeout" | "too few" ("unreadable": never written, see ``dropped``)
    versions: dict[int, str] = field(default_factory=dict)  # each member's payload object version (a versioned
    # store: S3 VersionId) the decider hashed; empty elsewhere, or when the decider did not read every member

    @classmethod
    def dropped(cls, round_: int) -> Decision:
        """What every learner takes for a round whose decision stays unreadable: no members, the round dropped."""
        return cls(round_, (), {}, -1, "unreadable")


def expected_bytes(like: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    """An upper bound on a delta's file size: its tensors at ``dtype`` plus safetensors' JSON header."""
    itemsize = dtype.itemsize
    return sum(t.numel() * itemsize + 256 + len(name) for name, t in like.items()) + 4096


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({k: v.detach().to("cpu").contiguous() for k, v in sorted(tensors.items())})


def state_digest(weights: dict[str, torch.Tensor]) -> str:
    """The SHA-256 of the payload ``publish_state`` writes for ``weights`` (job.json's ``start``)."""
    return hashlib.sha256(_tensor_bytes(weights)).hexdigest()


class RoundBucket:
    """The bucket of one DiLoCo job, as learner ``learner`` of ``learners`` sees it."""

    def __init__(self, url: str, learner: int, learners: int):
        self.url, self.learner, self.learners = str(url).rstrip("/"), learner, learners
        self.global_ = AdapterBucket(f"{self.url}/global", within=self.url)  # every path checked against the job's
        self.momentum = AdapterBucket(f"{self.url}/momentum", within=self.url)  # bucket root (rlvr.store.bucket)
        self.fs, self.root = self.global_.fs, self.global_.root.rsplit("/", 1)[0]  # the bucket's own path
        self.rounds = f"{self.root}/rounds"
        self._keeps_versions: bool | None = None  # asked once (keeps_versions)
        self._hashed: dict[tuple[int, int], tuple[str, str]] = {}  # (round, learner) -> (digest, object version)

    def _learner_bucket(self, k: int) -> AdapterBucket:
        return AdapterBucket(f"{self.url}/learner-{k:04d}", within=self.url)

    # ------------------------------------------------------------------------------------------- deltas
    def publish_delta(self, round_: int, delta: dict[str, torch.Tensor], record: dict) -> int:
        """Publish this learner's delta of ``round_``; returns the bytes written."""
        files = {TENSORS: _tensor_bytes(delta), RECORD: json.dumps({**record, "round": round_,
                                                                    "learner": self.learner}).encode()}
        return self._learner_bucket(self.learner).publish_files(round_, files).bytes

    def arrived(self, round_: int) -> list[int]:
        """Learners whose delta of ``round_`` has a manifest (not yet checked), ascending: one existence check per
        learner (polled while a round is open, so it must not grow with the rounds a learner has published)."""
        return [k for k in range(self.learners)
                if self.fs.exists(f"{self.root}/learner-{k:04d}/v{round_:08d}/{MANIFEST}")]

    def keeps_versions(self) -> bool:
        """Whether the bucket keeps every version of an object (S3 versioning "Enabled"); asked once."""
        if self._keeps_versions is None:
            self._keeps_versions = not self.global_.local and keeps_versions(self.fs, self.root)
        return self._keeps_versions

    def read_delta(self, round_: int, k: int, like: dict[str, torch.Tensor], dtype: torch.dtype,
                   digest: str | None = None, version: str | None = None) -> tuple[dict[str, torch.Tensor], str]:
        """Learner ``k``'s delta of ``round_``, checked against ``like`` (the trainable parameters: names, shapes)
        and ``dtype``; with ``digest``, the payload must be the one the decision names. RefusedDelta otherwise.

        ``version`` (the decision's object version, on a versioned store): that version of the payload, read
        bounded and checked against ``digest`` alone, so a delta replaced or deleted since the decision is still the
        decided bytes; when it cannot be had (no such version, no s3:GetObjectVersion permission), or on a
        directory, the current payload as without one. On a versioned store a read without ``version`` reads the
        payload's current object version (a HEAD, then that version) and remembers it for ``decide``."""
        where = f"learner {k}'s delta of round {round_}"
        limit = expected_bytes(like, dtype)
        payload, pinned, current = None, "", None
        if version is not None and not self.global_.local:
            try:
                payload = read_remote(self.fs, self._payload_path(round_, k), limit + 1, version)
            except (OSError, ValueError) as err:
                pinned = f" (its decided version could not be read: {err})"
            if payload is not None and len(payload) > limit:
                raise RefusedDelta(f"{where}: larger than a delta of this model")
        if payload is None:
            try:
                if version is None and self.keeps_versions():
                    current = object_version(self.fs, self._payload_path(round_, k))
                files = self._learner_bucket(k).read(round_, {TENSORS: limit, RECORD: 64 << 10},
                                                     {TENSORS: current} if current else None)
            except (ManifestError, TornVersionError, FileNotFoundError, OSError) as err:
                raise UnreadableDelta(f"{where}: {err}{pinned}") from None
            payload = files[TENSORS]
        got = hashlib.sha256(payload).hexdigest()
        if digest is not None and got != digest:
            raise UnreadableDelta(f"{where} changed after the round's decision{pinned}")
        if current is not None and _OBJECT_VERSION.fullmatch(current):
            self._hashed = {key: v for key, v in self._hashed.items() if key[0] >= round_}  # older rounds: decided
            self._hashed[round_, k] = got, current
        try:
            tensors = load(payload)
        except (SafetensorError, ValueError, RuntimeError):
            raise RefusedDelta(f"{where}: not a safetensors file") from None
        if tensors.keys() != like.keys():
            raise RefusedDelta(f"{where}: other tensor names than this model's trainable parameters")
        for name, t in tensors.items():
            if t.dtype != dtype or t.shape != like[name].shape:
                raise RefusedDelta(f"{where}: {name} is {t.dtype} {tuple(t.shape)}, not {dtype} "
                                   f"{tuple(like[name].shape)}")
            if not bool(torch.isfinite(t).all()):
                raise RefusedDelta(f"{where}: {name} holds a value that is not finite")
        return tensors, got

    def _payload_path(self, round_: int, k: int) -> str:
        return f"{self.root}/learner-{k:04d}/v{round_:08d}/{TENSORS}"

    # ----------------------------------------------------------------------------------------- decisions
    def _decision_path(self, round_: int) -> str:
        return f"{self.rounds}/{round_:08d}.json"

    def decide(self, decision: Decision) -> bool:
        """Create ``decision`` unless the round has one; whether this call created it. Its ``versions``, else on a
        versioned store the object version of each member's payload that this learner read and hashed to the
        decision's digest (``read_delta``): recorded only when every member has one."""
        versions = decision.versions or self._hashed_versions(decision)
        record = {"round": decision.round, "members": list(decision.members),
                  "digests": {str(k): v for k, v in decision.digests.items()},
                  "closed_by": decision.closed_by, "reason": decision.reason}
        data = json.dumps(record).encode()
        if versions:
            pinned = json.dumps({**record, "versions": {str(k): versions[k] for k in sorted(versions)}}).encode()
            data = pinned if len(pinned) <= MAX_DECISION_BYTES else data  # too many learners to pin: digests only
        return self.create_file(self._decision_path(decision.round), data)

    def _hashed_versions(self, decision: Decision) -> dict[int, str]:
        seen = {k: self._hashed.get((decision.round, k)) for k in decision.members}
        if seen and all(s is not None and s[0] == decision.digests.get(k) for k, s in seen.items()):
            return {k: s[1] for k, s in seen.items()}
        return {}

    def job(self, identity: dict | None, timeout_s: float = 0.0) -> dict:
        """The job this bucket belongs to: ``identity`` recorded in job.json when given and there is none (created
        once, exclusively, by the learner that claimed the start: it holds the start weights' digest), else the
        identity recorded there, waited for up to ``timeout_s``; RefusedDelta when that is not a small JSON object
        or none appears."""
        if identity is not None:
            self.create_file(f"{self.root}/{JOB}", json.dumps(identity, sort_keys=True).encode())
        deadline = time.monotonic() + timeout_s
        while (recorded := self.read_record(self.root, JOB, f"diloco: {self.url}/{JOB}")) is None:
            if time.monotonic() >= deadline:
                raise RefusedDelta(f"diloco: {self.url}/{JOB} did not appear within {timeout_s:g} s "
                                   "(diloco.round_timeout_s): is the learner that claimed the job's start "
                                   "(rounds/start.claim) running? Else remove rounds/start.claim")
            time.sleep(0.2)
        return recorded

    def has_job(self) -> bool:
        return self.fs.exists(f"{self.root}/{JOB}")

    def read_record(self, directory: str, name: str, what: str) -> dict | None:
        """The small JSON object at ``directory/name`` (None when there is none): read bounded, as a regular file
        inside the bucket (never a FIFO's blocking read, never through a link); RefusedDelta for anything else."""
        try:
            if self.global_.local:
                raw = read_local(directory, name, MAX_DECISION_BYTES + 1, self.url, self.root)
            else:
                raw = read_remote(self.fs, f"{directory}/{name}", MAX_DECISION_BYTES + 1)
        except FileNotFoundError:
            return None
        except (ManifestError, OSError) as err:
            raise RefusedDelta(f"{what}: {err}") from None
        try:
            record = json.loads(raw)
        except ValueError:  # not JSON (on a store without atomic writes, perhaps one half written for a moment)
            record = None
        if len(raw) > MAX_DECISION_BYTES or not isinstance(record, dict):
            raise RefusedDelta(f"{what} is not what rlvr writes (a small JSON object); remove it or use another "
                               "diloco.bucket")
        return record

    def verdict(self, round_: int, k: int, taken: bool | None = None) -> bool | None:
        """Whether learner ``k``'s pinned delta of ``round_`` is applied (True) or dropped (False) by every learner:
        recorded once, by the first learner that read it (``taken=True``) or gave up on reading it (``False``), in
        ``rounds/{round}-{k}.verdict``; returns the recorded verdict (None: none yet, or one rlvr does not write)."""
        name = f"{round_:08d}-{k:04d}.verdict"
        if taken is not None:
            try:
                self.create_file(f"{self.rounds}/{name}", json.dumps({"taken": taken}).encode())
            except (ManifestError, OSError):  # rounds/ made unwritable: no verdict recorded (the caller's None)
                pass
        try:
            record = self.read_record(self.rounds, name, f"learner {k}'s verdict of round {round_}")
        except RefusedDelta:
            return None
        return record.get("taken") if record is not None and type(record.get("taken")) is bool else None

    def claim_start(self) -> bool:
        """Whether this learner is the one that publishes the job's starting weights (created once, exclusively)."""
        return self.create_file(f"{self.rounds}/start.claim", json.dumps({"learner": self.learner}).encode())

    def create_file(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists; whether this call created it (on S3, whether it holds
        this call's bytes: a conditional PUT, the second writer refused by the store; rlvr.store.bucket.create_once)."""
        if self.global_.local:  # complete when it appears, no link followed (rlvr.store.bucket.write_local)
            return write_local(path, data, self.root, exclusive=True)
        return create_once(self.fs, path, data)

    def decided(self) -> int:
        """Where the job is: the last round r such that rounds 1..r all have a decision file (0: none yet). A
        global/ version beyond it has no decision behind it and is never taken."""
        try:
            names = self.fs.ls(self.rounds, detail=False)
        except FileNotFoundError:
            return 0
        found = {int(m[1]) for m in (re.fullmatch(r"([0-9]{8})\.json", n.rstrip("/").rsplit("/", 1)[-1])
                                     for n in names) if m}
        last = 0
        while last + 1 in found:
            last += 1
        return last

    def decision(self, round_: int) -> Decision | None:
        """Round ``round_``'s decision, None while there is none; RefusedDelta for one rlvr does not write (what a
        learner waits past: rlvr.run.diloco)."""
        record = self.read_record(self.rounds, self._decision_path(round_).rsplit("/", 1)[1],
                              f"round {round_}'s decision in {self.url}/rounds")
        if record is None:
            return None
        members, digests = record.get("members"), record.get("digests")
        ok = (record.get("round") == round_ and isinstance(members, list)
              and all(type(k) is int and 0 <= k < self.learners for k in members) and len(set(members)) == len(members)
              and isinstance(digests, dict) and set(digests) == {str(k) for k in members}
              and all(isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for v in digests.values())
              and type(record.get("closed_by")) is int and record.get("reason") in ("all", "timeout", "too few"))
        versions = record.get("versions", {})  # optional: a decision on a store without versions has none
        ok = ok and isinstance(versions, dict) and ("versions" not in record or set(versions) == set(digests)) and all(
            isinstance(v, str) and _OBJECT_VERSION.fullmatch(v) for v in versions.values())
        if not ok:
            raise RefusedDelta(f"round {round_}'s decision in {self.url}/rounds is not what rlvr writes")
        return Decision(round_, tuple(sorted(members)), {int(k): v for k, v in digests.items()},
                        record["closed_by"], record["reason"], {int(k): v for k, v in versions.items()})

    # ---------------------------------------------------------------------------------------- shared state
    def publish_state(self, round_: int, weights: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor] | None,
                      record: dict) -> None:
        """The weights (and momentum) after ``round_``: written by one learner only (the round's decider, or the
        start's claimant), since a second writer would truncate files a reader may be reading."""
        if self.has_state(round_):
            return
        meta = json.dumps({**record, "round": round_}).encode()
        if momentum is not None:
            self.momentum.publish_files(round_, {TENSORS: _tensor_bytes(momentum), RECORD: meta})
        self.global_.publish_files(round_, {TENSORS: _tensor_bytes(weights), RECORD: meta})  # last: it marks the round

    def has_state(self, round_: int) -> bool:
        """Whether the weights after ``round_`` are published (their manifest, written last, exists): one request,
        however many rounds the job has had."""
        return self.fs.exists(f"{self.global_.root}/v{round_:08d}/{MANIFEST}")

    def latest_state(self) -> int | None:
        return self.global_.latest()

    def wait_for_state(self, round_: int, timeout_s: float) -> None:
        """Wait until the weights after ``round_`` are published (RefusedDelta after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while not self.has_state(round_):
            if time.monotonic() > deadline:
                raise RefusedDelta(f"the shared weights of round {round_} did not appear in {self.url}/global within "
                                   f"{timeout_s:g} s (diloco.round_timeout_s): is the learner that publishes them "
                                   "running?")
            time.sleep(0.2)

    def read_state(self, round_: int, like: dict[str, torch.Tensor],
                   digest: str | None = None) -> tuple[dict, dict | None]:
        """(weights, momentum or None) after ``round_``, checked against ``like``; with ``digest`` (the job's start,
        job.json), the weights must be those bytes (RefusedDelta naming the file and what to do)."""
        weights = self._checked(self.global_, round_, like, "the shared weights", digest)
        momentum = None
        if self.fs.exists(f"{self.momentum.root}/v{round_:08d}/{MANIFEST}"):
            momentum = self._checked(self.momentum, round_, like, "the outer momentum")
        return weights, momentum

    def _checked(self, bucket: AdapterBucket, round_: int, like: dict[str, torch.Tensor], what: str,
                 digest: str | None = None) -> dict:
        for attempt in range(50):  # a version replaced while read (a republish) reads torn for a moment
            try:
                payload = bucket.read(round_)[TENSORS]
                if digest is not None and hashlib.sha256(payload).hexdigest() != digest:
                    raise RefusedDelta(f"{bucket.version_url(round_)}/{TENSORS} is not the job's start (job.json's "
                                       "'start' digest): it was replaced. Restore it, or start a new job with another "
                                       "diloco.bucket")
                tensors = load(payload)
                break
            except (TornVersionError, FileNotFoundError) as err:
                if attempt == 49:
                    raise RefusedDelta(f"{what} of round {round_}: {err}") from None
                time.sleep(0.1)
            except (ManifestError, OSError, SafetensorError, ValueError) as err:
                raise RefusedDelta(f"{what} of round {round_}: {err}") from None
        if tensors.keys() != like.keys() or any(t.shape != like[k].shape or t.dtype != torch.float32 or
                                                not bool(torch.isfinite(t).all()) for k, t in tensors.items()):
            raise RefusedDelta(f"{what} of round {round_} do not fit this model")
        return tensors
