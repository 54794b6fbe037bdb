"""The bucket on an object store for real: moto's S3 server on loopback (tests/s3_server.py), reached through s3fs
as a user reaches MinIO or R2. The same protocol as on a directory — adapter versions published, read and
collected, DiLoCo's decisions, deltas, job.json and verdicts, shared groups — and what a store adds: decisions and
claims created with a conditional PUT (If-None-Match: *) that the store refuses to the second writer, another
machine's new versions seen by a reader that listed before them, reads bounded on the wire, and a throttled (503),
conflicting (409) or dropped request retried with nothing lost. The directory tests whose logic holds on a store
are run here against it unchanged (the hostile-bucket, hostile-peer and shared-group ones); the link and FIFO
cases have no counterpart on a store. Unit level: bucket calls only, no training run."""

import hashlib
import json
import time

import pytest
import torch
from safetensors.torch import save

from rlvr.core.outer import nesterov_step, outer_gradient
from rlvr.store.bucket import AdapterBucket, ManifestError, TornVersionError
from rlvr.store.rounds import Decision, RefusedDelta, RoundBucket
from rlvr.store.shared_groups import GroupBucket, RefusedGroups
from tests import test_hostile_bucket as hostile_bucket
from tests import test_hostile_peers as hostile_peers
from tests import test_shared_rollouts as shared_rollouts
from tests.test_hostile_bucket import LIKE, START, _delta, _two_deltas, _update

pytest_plugins = ["tests.s3_server"]  # the moto server, the proxy and the s3_url fixtures

FILES = {"adapter_model.safetensors": b"w" * 100, "adapter_config.json": b"{}"}


def _files(v: int) -> dict[str, bytes]:
    return {"adapter_model.safetensors": bytes([v]) * (10 + v), "adapter_config.json": b"{}"}


def _store(url: str):
    """(filesystem, path) for ``url``: what a hostile writer uses to put any bytes at any key."""
    import fsspec

    return fsspec.filesystem("s3", use_listings_cache=False), url.removeprefix("s3://")


@pytest.fixture(params=["dir", "s3"])
def bucket_url(request, tmp_path):
    """The same protocol on a local directory and on the S3 server."""
    return str(tmp_path / "bucket") if request.param == "dir" else request.getfixturevalue("s3_url")


# ------------------------------------------------------------------------------------------------- the protocol
def test_adapter_versions_publish_read_and_collect(bucket_url):
    bucket = AdapterBucket(bucket_url)
    assert bucket.versions() == [] and bucket.latest() is None
    for v in range(1, 6):
        published = bucket.publish_files(v, _files(v))
        assert published.bytes == 12 + v and published.url == f"{bucket_url}/v{v:08d}"
    assert bucket.versions() == [1, 2, 3, 4, 5] and bucket.latest() == 5
    assert bucket.read(3) == _files(3)
    bucket.publish_files(3, FILES)  # republished (a resumed run): the new bytes, checked against the new manifest
    assert bucket.read(3) == FILES
    assert bucket.gc(keep=2) == [1, 2, 3] and bucket.versions() == [4, 5]
    with pytest.raises(FileNotFoundError):
        bucket.read(2)


def test_a_peers_new_version_is_seen_by_a_reader_that_listed_before_it(s3_url):
    """Before: fsspec kept every listing until told otherwise, and a write from another machine tells nobody, so a
    learner that had listed learner-0001/ never saw its next version (nor round 2's delta, nor rounds/ beyond)."""
    from s3fs import S3FileSystem

    reader = RoundBucket(s3_url, 0, 2)
    peers = reader._learner_bucket(1)  # the learner's view of learner 1's versions, on the learner's filesystem
    RoundBucket(s3_url, 1, 2).publish_delta(1, _delta(0.1), {})
    RoundBucket(s3_url, 1, 2).decide(Decision(1, (1,), {1: "a" * 64}, 1, "all"))
    assert peers.versions() == [1] and reader.arrived(2) == [] and reader.decided() == 1
    S3FileSystem.clear_instance_cache()  # the peer on another machine: its own filesystem, its own caches
    RoundBucket(s3_url, 1, 2).publish_delta(2, _delta(0.2), {})
    RoundBucket(s3_url, 1, 2).decide(Decision(2, (1,), {1: "b" * 64}, 1, "all"))
    assert peers.versions() == [1, 2] and reader.arrived(2) == [1] and reader.decided() == 2


def test_rounds_on_the_store(bucket_url):
    """A job's life on the store: the start claimed once, job.json created once, deltas published and read with
    their digests, a round decided once, a verdict recorded once, and the outer step every learner computes."""
    first, second = RoundBucket(bucket_url, 0, 2), RoundBucket(bucket_url, 1, 2)
    assert not first.has_job() and first.claim_start() and not second.claim_start()
    identity = {"learners": 2, "start": "0" * 64}
    assert first.job(identity) == identity and second.job({"learners": 3}) == identity and first.has_job()
    first.publish_state(0, START, None, {"reason": "start"})
    assert second.latest_state() == 0 and torch.equal(second.read_state(0, LIKE)[0]["layer.lora_A.weight"],
                                                      START["layer.lora_A.weight"])
    decision = _two_deltas(bucket_url)  # both learners publish round 1's delta; learner 1 decides it
    assert first.arrived(1) == [0, 1] and first.decided() == 1
    assert not first.decide(Decision(1, (0,), {0: decision.digests[0]}, 0, "timeout"))  # decided already
    assert first.decision(1) == decision
    tensors, digest = first.read_delta(1, 1, LIKE, torch.float32, decision.digests[1])
    assert digest == decision.digests[1] and all(torch.equal(tensors[k], _delta(0.2)[k]) for k in LIKE)
    assert first.verdict(1, 1) is None and first.verdict(1, 1, taken=True) is True
    assert second.verdict(1, 1, taken=False) is True  # the first verdict counts for everyone
    weights = _update(bucket_url)._outer_step(1, decision, START, None, LIKE)[0]
    expected = nesterov_step(START, outer_gradient([_delta(0.1), _delta(0.2)]), None, 0.7, 0.9)[0]
    assert all(torch.equal(weights[k], expected[k]) for k in LIKE)


def test_shared_groups_on_the_store(bucket_url):
    sent = shared_rollouts._shared()
    written = GroupBucket(bucket_url, 1, 2).publish(sent)
    for step in (4, 5):
        GroupBucket(bucket_url, 1, 2).publish(shared_rollouts._shared(step=step, version=step - 1))
    got, size = GroupBucket(bucket_url, 0, 2).read(1, 3, shared_rollouts.LIMITS)
    assert size == written and torch.equal(got.completion_ids, sent.completion_ids)
    assert torch.equal(got.behaviour_logp, sent.behaviour_logp) and got.row_ids.tolist() == [1, 7]
    assert GroupBucket(bucket_url, 0, 2).arrived(5) == [1] and GroupBucket(bucket_url, 0, 2).arrived(6) == []
    GroupBucket(bucket_url, 1, 2).gc(keep=1)
    with pytest.raises(RefusedGroups, match="manifest|not found|No such|does not exist|v00000003"):
        GroupBucket(bucket_url, 0, 2).read(1, 3, shared_rollouts.LIMITS)
    assert GroupBucket(bucket_url, 0, 2).read(1, 5, shared_rollouts.LIMITS)[0].step == 5


# ----------------------------------------------------------------------------------- created once, on a store
def test_two_learners_deciding_at_once_the_store_refuses_the_second(s3_url, monkeypatch):
    """Both learners found the round closable and neither saw a decision (their existence checks both came before
    either write: what two learners within milliseconds do). Before: both wrote, the second replacing the first
    under whoever had read it. Now the second PUT carries If-None-Match: * and the store refuses it (412)."""
    from s3fs import S3FileSystem

    async def nothing_there(self, path, **kwargs):  # the race: every existence check answered before any write
        return False

    monkeypatch.setattr(S3FileSystem, "_exists", nothing_there)
    monkeypatch.setattr(S3FileSystem, "exists", lambda self, path, **kwargs: False)  # its own copy of _exists
    first = Decision(1, (0, 1), {0: "a" * 64, 1: "b" * 64}, 0, "all")
    second = Decision(1, (1,), {1: "b" * 64}, 1, "timeout")
    assert RoundBucket(s3_url, 0, 2).decide(first)
    S3FileSystem.clear_instance_cache()  # the other learner: another machine
    assert not RoundBucket(s3_url, 1, 2).decide(second)
    assert RoundBucket(s3_url, 1, 2).decision(1) == first
    assert RoundBucket(s3_url, 0, 2).claim_start() and not RoundBucket(s3_url, 1, 2).claim_start()
    assert RoundBucket(s3_url, 1, 2).verdict(1, 0, taken=False) is False
    assert RoundBucket(s3_url, 0, 2).verdict(1, 0, taken=True) is False  # the first verdict stands


def test_a_create_whose_answer_was_lost_is_still_its_writers(s3_url, proxy):
    """The store kept the decision but its answer was lost (a 503 after the write): the client sends the PUT again,
    the store refuses it (the object exists: its own), and the learner reads its own bytes back - it decided."""
    decision = Decision(1, (0,), {0: "a" * 64}, 0, "all")
    proxy.fail(1, "lost_answer", method="PUT")
    assert RoundBucket(s3_url, 0, 2).decide(decision)
    puts = [status for method, _, status in proxy.seen if method == "PUT"]
    assert puts == [503, 412] and RoundBucket(s3_url, 1, 2).decision(1) == decision
    proxy.fail(1, "lost_answer", method="PUT")
    assert RoundBucket(s3_url, 0, 2).claim_start() and not RoundBucket(s3_url, 1, 2).claim_start()


def test_a_create_racing_another_write_is_tried_again(s3_url, proxy):
    """409 ConditionalRequestConflict: S3's answer to a conditional write while another write of the key is under
    way. Before: neither botocore nor s3fs retries a 409, and the decision was not written (an OSError)."""
    decision = Decision(1, (0,), {0: "a" * 64}, 0, "all")
    proxy.fail(2, "conflict", method="PUT")
    assert RoundBucket(s3_url, 0, 2).decide(decision)
    assert [s for m, _, s in proxy.seen if m == "PUT"] == [409, 409, 200]
    assert RoundBucket(s3_url, 1, 2).decision(1) == decision


# ------------------------------------------------------------------------------------------ a store's bad moments
@pytest.mark.parametrize("fault", ["slowdown", "drop"])
def test_throttled_and_dropped_requests_are_retried_and_nothing_is_lost(s3_url, proxy, fault):
    """503 SlowDown (S3's answer to a fast ramp), or a connection closed after the store took the request: botocore
    and s3fs retry with backoff (their defaults; AWS_RETRY_MODE and AWS_MAX_ATTEMPTS tune them), so a publish, a
    decision and a read each go through, and every byte read is the byte written."""
    proxy.fail(2, fault)  # the next two requests, whatever they are
    RoundBucket(s3_url, 1, 2).publish_delta(1, _delta(0.1), {})
    proxy.fail(1, fault, method="PUT")
    assert RoundBucket(s3_url, 1, 2).decide(Decision(1, (1,), {1: "a" * 64}, 1, "all"))
    proxy.fail(1, fault, method="GET")
    tensors, _ = RoundBucket(s3_url, 0, 2).read_delta(1, 1, LIKE, torch.float32)
    assert all(torch.equal(tensors[k], _delta(0.1)[k]) for k in LIKE)
    assert RoundBucket(s3_url, 0, 2).decision(1).members == (1,) and proxy.faults_left() == 0
    assert sum(status in (503, None) for _, _, status in proxy.seen) == 4


def test_a_read_takes_no_more_bytes_off_the_wire_than_the_manifest_declares(s3_url, proxy):
    """A peer replaces its 1 KB payload by 8 MB after publishing: the reader refuses it (torn) having fetched about
    the declared size, not the object. Before: s3fs's read-ahead fetched the whole object to return a few bytes."""
    bucket = AdapterBucket(f"{s3_url}/learner-0001")
    bucket.publish_files(1, {"adapter_model.safetensors": b"x" * 1024, "adapter_config.json": b"{}"})
    fs, path = _store(f"{s3_url}/learner-0001/v00000001/adapter_model.safetensors")
    fs.pipe_file(path, b"y" * (8 << 20))
    before = proxy.relayed
    with pytest.raises(TornVersionError, match="does not match its manifest"):
        bucket.read(1)
    assert proxy.relayed - before < 64 << 10


# ------------------------------------------------------------------------------------ hostile writers, on a store
@pytest.mark.parametrize("test", [
    hostile_bucket.test_shared_weights_no_decision_gives_are_never_taken,
    hostile_bucket.test_a_delta_replaced_after_its_round_was_decided_stops_every_learner_alike,
    hostile_peers.test_a_replaced_start_is_refused_on_every_read,
    shared_rollouts.test_a_shared_group_round_trips_exactly,
    shared_rollouts.test_an_empty_step_round_trips,
], ids=lambda t: t.__name__.removeprefix("test_"))
def test_the_directory_tests_hold_on_the_store(s3_url, test):
    test(s3_url)


@pytest.mark.parametrize("settings, bounded", [([], True), (["diloco.max_delta_ratio=0"], False)])
def test_a_huge_finite_delta_is_bounded_on_the_store(s3_url, settings, bounded):
    hostile_bucket.test_a_huge_finite_delta_is_bounded_by_default_and_a_non_finite_step_is_refused(
        s3_url, settings, bounded)


_GROUP_CASES = next(m for m in shared_rollouts.test_hostile_groups_are_refused.pytestmark if m.name == "parametrize")


@pytest.mark.parametrize(*_GROUP_CASES.args)
def test_hostile_groups_are_refused_on_the_store(s3_url, case, tensors, record, message):
    shared_rollouts.test_hostile_groups_are_refused(s3_url, case, tensors, record, message)


def test_a_torn_missing_or_oversize_payload_and_a_malformed_manifest_are_refused(s3_url):
    """What a peer with write access can leave on a store (no links or FIFOs there): a payload missing or changed
    under its manifest, one declaring more than a delta can be, a manifest that is not JSON or names another file."""
    learner = RoundBucket(s3_url, 1, 2)
    learner.publish_delta(1, _delta(0.1), {})
    fs, version = _store(f"{s3_url}/learner-0001/v00000001")
    reader = RoundBucket(s3_url, 0, 2)
    payload = fs.cat_file(f"{version}/adapter_model.safetensors")
    fs.pipe_file(f"{version}/adapter_model.safetensors", payload[:-4] + b"\0\0\0\0")  # same size, other bytes
    with pytest.raises(RefusedDelta, match="does not match its manifest"):
        reader.read_delta(1, 1, LIKE, torch.float32)
    fs.rm(f"{version}/adapter_model.safetensors")
    with pytest.raises(RefusedDelta, match="adapter_model.safetensors is missing"):
        reader.read_delta(1, 1, LIKE, torch.float32)
    huge = save({k: torch.zeros(64, 64) for k in LIKE})  # a valid file, far beyond this model's parameters
    learner._learner_bucket(1).publish_files(1, {"adapter_model.safetensors": huge, "adapter_config.json": b"{}"})
    with pytest.raises(RefusedDelta, match="declares .* more than"):
        reader.read_delta(1, 1, LIKE, torch.float32)
    for manifest in (b"{", json.dumps({"version": 1, "files": {"../../job.json": {"bytes": 1, "sha256": "0" * 64}}})
                     .encode(), b"[" * (80 << 10)):
        fs.pipe_file(f"{version}/manifest.json", manifest)
        with pytest.raises(RefusedDelta, match="not JSON|exactly|larger than"):
            reader.read_delta(1, 1, LIKE, torch.float32)
    with pytest.raises(ManifestError):
        AdapterBucket(f"{s3_url}/learner-0001").read(1)


@pytest.mark.parametrize("kind", ["half_written", "json_list", "learner_9_of_2"])
def test_a_decision_that_cannot_be_read_drops_the_round_at_the_timeout_on_the_store(s3_url, kind):
    record = {"half_written": b"{", "json_list": b"[1, 2]",
              "learner_9_of_2": json.dumps({"round": 1, "members": [9], "digests": {"9": "a" * 64}, "closed_by": 9,
                                            "reason": "all"}).encode()}[kind]
    fs, path = _store(f"{s3_url}/rounds/00000001.json")
    fs.pipe_file(path, record)
    with pytest.raises(RefusedDelta):
        RoundBucket(s3_url, 0, 2).decision(1)
    update = _update(s3_url)  # round_timeout_s = 0.5
    started = time.monotonic()
    decision = update._wait_for_decision(1, LIKE)
    assert time.monotonic() - started < 5
    assert decision.members == () and decision.reason == "unreadable" and update.totals["refused_rounds"] == 1


def test_a_pinned_nan_delta_costs_its_share_on_the_store(s3_url):
    """A hostile learner decides round 1 itself, pinning its own NaN delta: every learner drops that share and
    applies the honest one, to the same weights."""
    RoundBucket(s3_url, 0, 2).publish_delta(1, _delta(0.1), {})
    RoundBucket(s3_url, 1, 2).publish_delta(1, _delta(float("nan")), {})
    fs, version = _store(f"{s3_url}/learner-0001/v00000001")
    digests = {0: RoundBucket(s3_url, 0, 2).read_delta(1, 0, LIKE, torch.float32)[1],
               1: hashlib.sha256(fs.cat_file(f"{version}/adapter_model.safetensors")).hexdigest()}
    decision = Decision(1, (0, 1), digests, 1, "all")
    assert RoundBucket(s3_url, 1, 2).decide(decision)
    first, second = _update(s3_url), _update(s3_url)
    a, _, averaged, _ = first._outer_step(1, decision, START, None, LIKE)
    b = second._outer_step(1, decision, START, None, LIKE)[0]
    expected = nesterov_step(START, outer_gradient([_delta(0.1)]), None, 0.7, 0.9)[0]
    assert averaged == 1 and first.totals["refused"] == 1
    assert all(torch.equal(a[k], expected[k]) and torch.equal(b[k], expected[k]) for k in LIKE)


def test_the_proxy_adds_its_delay_and_holds_bodies_to_its_bandwidth(moto_server, s3_env):
    """The link the swarm benchmark puts in front of the store: 4 listings through a proxy that adds 0.05 s to each
    round trip take at least 4 x 0.05 = 0.2 s; a 20,000-byte PUT through one at 100,000 bytes/s at least 0.2 s."""
    import urllib.request

    from tests.s3_server import BUCKET, FaultyProxy

    slow = FaultyProxy(moto_server.url, delay_s=0.05)
    narrow = FaultyProxy(moto_server.url, bytes_per_s=100_000)
    try:
        started = time.monotonic()
        for _ in range(4):
            urllib.request.urlopen(f"{slow.url}/{BUCKET}", timeout=10).close()
        listed = time.monotonic() - started
        started = time.monotonic()
        put = urllib.request.Request(f"{narrow.url}/{BUCKET}/blob", data=b"x" * 20_000, method="PUT")
        urllib.request.urlopen(put, timeout=10).close()
        written = time.monotonic() - started
    finally:
        slow.close()
        narrow.close()
    assert [status for _, _, status in slow.seen] == [200] * 4 and narrow.seen == [("PUT", f"/{BUCKET}/blob", 200)]
    assert listed >= 4 * 0.05 and written >= 20_000 / 100_000
