"""A decision pins each member's delta by the object version the decider hashed, on a store that keeps versions (S3
versioning "Enabled"): a delta replaced or deleted after its round's decision is still read as the decided bytes,
its SHA-256 checked. On a store without versions nothing changes: no versions in the decision, and a replaced delta
is refused as changed after the round's decision. Against moto's S3 server (tests/s3_server.py); a decision's
``versions`` field, when present, is checked as strictly as its digests. Unit level: bucket calls only."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import save

from rlvr.store.rounds import Decision, RefusedDelta, RoundBucket, UnreadableDelta

pytest_plugins = ["tests.s3_server"]  # the moto server and the s3_env / s3_url fixtures

LIKE = {"layer.lora_A.weight": torch.zeros(2, 3), "layer.lora_B.weight": torch.zeros(3, 2)}
VERSIONED = "rlvr-versioned"  # a second bucket on the server, with versioning enabled


def _delta(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in LIKE.items()}


def _digest(value: float) -> str:
    """The SHA-256 of the payload a learner publishes for ``_delta(value)``: its tensors saved in name order."""
    return hashlib.sha256(save(dict(sorted(_delta(value).items())))).hexdigest()


def _same(tensors: dict[str, torch.Tensor], value: float) -> bool:
    return tensors.keys() == LIKE.keys() and all(torch.equal(tensors[k], _delta(value)[k]) for k in LIKE)


def _store():
    """The filesystem a test (or a hostile writer) uses to reach the store directly."""
    import fsspec

    return fsspec.filesystem("s3", use_listings_cache=False)


def _head_version(url: str, key: str) -> str:
    """The VersionId the store gives the object now at ``url/key`` (botocore's HEAD, not the code under test)."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return _store().call_s3("head_object", Bucket=bucket, Key=f"{prefix}/{key}")["VersionId"]


@pytest.fixture
def versioned_url(s3_env) -> str:
    """A job's bucket URL in a fresh bucket that keeps every version of an object."""
    fs = _store()
    fs.mkdir(VERSIONED)
    fs.call_s3("put_bucket_versioning", Bucket=VERSIONED, VersioningConfiguration={"Status": "Enabled"})
    return f"s3://{VERSIONED}/job"


def _decided(url: str, members=(1,)) -> Decision:
    """Learners publish round 1's deltas (learner k: ``0.1 * (k + 1)``); learner 0 reads them and decides."""
    for k in members:
        RoundBucket(url, k, 2).publish_delta(1, _delta(0.1 * (k + 1)), {})
    decider = RoundBucket(url, 0, 2)
    digests = {k: decider.read_delta(1, k, LIKE, torch.float32)[1] for k in members}
    assert decider.decide(Decision(1, tuple(members), digests, 0, "all"))
    return RoundBucket(url, 0, 2).decision(1)


PAYLOAD = "learner-0001/v00000001/adapter_model.safetensors"


# ------------------------------------------------------------------------------------------------- a versioned store
@pytest.mark.parametrize("after", ["replaced", "deleted"])
def test_a_delta_replaced_or_deleted_after_its_decision_is_read_as_the_decided_bytes(versioned_url, after):
    decision = _decided(versioned_url)
    decided_version = _head_version(versioned_url, PAYLOAD)
    assert decision.digests == {1: _digest(0.2)} and decision.versions == {1: decided_version}
    if after == "replaced":  # republished with other bytes: a new payload and manifest, the old version kept
        RoundBucket(versioned_url, 1, 2).publish_delta(1, _delta(0.9), {})
        assert _head_version(versioned_url, PAYLOAD) != decided_version
    else:
        _store().rm(f"{versioned_url.removeprefix('s3://')}/learner-0001/v00000001", recursive=True)
    reader = RoundBucket(versioned_url, 1, 2)
    with pytest.raises(UnreadableDelta):  # the current object: not the decided bytes (or none at all)
        reader.read_delta(1, 1, LIKE, torch.float32, decision.digests[1])
    tensors, digest = reader.read_delta(1, 1, LIKE, torch.float32, decision.digests[1], decision.versions[1])
    assert digest == _digest(0.2) and _same(tensors, 0.2)


def test_a_pinned_version_is_checked_against_the_decisions_digest(versioned_url):
    decision = _decided(versioned_url)
    RoundBucket(versioned_url, 1, 2).publish_delta(1, _delta(0.9), {})
    other = _head_version(versioned_url, PAYLOAD)  # a real version of the payload, but not the decided bytes
    with pytest.raises(UnreadableDelta, match="changed after the round's decision"):
        RoundBucket(versioned_url, 0, 2).read_delta(1, 1, LIKE, torch.float32, decision.digests[1], other)
    # a version the store does not have: the current object, as without one (the digest still decides)
    assert RoundBucket(versioned_url, 0, 2).read_delta(1, 1, LIKE, torch.float32, _digest(0.9), "no-such")[1] \
        == _digest(0.9)


def test_the_decider_pins_the_version_it_hashed_when_the_delta_is_replaced_before_it_decides(versioned_url):
    learner = RoundBucket(versioned_url, 1, 2)
    learner.publish_delta(1, _delta(0.2), {})
    first = _head_version(versioned_url, PAYLOAD)
    decider = RoundBucket(versioned_url, 0, 2)
    digest = decider.read_delta(1, 1, LIKE, torch.float32)[1]
    learner.publish_delta(1, _delta(0.9), {})  # between the decider's read and its decision
    assert decider.decide(Decision(1, (1,), {1: digest}, 0, "all"))
    decision = decider.decision(1)
    assert decision.digests == {1: _digest(0.2)} and decision.versions == {1: first}
    assert _same(decider.read_delta(1, 1, LIKE, torch.float32, decision.digests[1], decision.versions[1])[0], 0.2)


def test_a_decision_round_trips_with_every_members_version(versioned_url):
    decision = _decided(versioned_url, members=(0, 1))
    assert RoundBucket(versioned_url, 1, 2).keeps_versions()
    versions = {0: _head_version(versioned_url, "learner-0000/v00000001/adapter_model.safetensors"),
                1: _head_version(versioned_url, PAYLOAD)}
    assert decision == Decision(1, (0, 1), {0: _digest(0.1), 1: _digest(0.2)}, 0, "all", versions)
    raw = json.loads(_store().cat_file(f"{versioned_url.removeprefix('s3://')}/rounds/00000001.json"))
    assert raw["versions"] == {"0": versions[0], "1": versions[1]}
    # a member this learner did not read (its digest from elsewhere): nothing pinned, the decision as before
    other = RoundBucket(versioned_url, 1, 2)
    assert other.decide(Decision(2, (1,), {1: _digest(0.2)}, 1, "all")) and other.decision(2).versions == {}
    # versions given by the caller are recorded as given
    assert other.decide(Decision(3, (1,), {1: _digest(0.2)}, 1, "all", {1: versions[1]}))
    assert other.decision(3).versions == {1: versions[1]}


# ---------------------------------------------------------------------------------------------- an unversioned store
def test_on_a_store_without_versions_a_replaced_delta_is_still_refused(s3_url):
    decision = _decided(s3_url)
    assert not RoundBucket(s3_url, 0, 2).keeps_versions() and decision.versions == {}
    raw = json.loads(_store().cat_file(f"{s3_url.removeprefix('s3://')}/rounds/00000001.json"))
    assert "versions" not in raw
    RoundBucket(s3_url, 1, 2).publish_delta(1, _delta(0.9), {})
    with pytest.raises(UnreadableDelta, match="changed after the round's decision"):
        RoundBucket(s3_url, 0, 2).read_delta(1, 1, LIKE, torch.float32, decision.digests[1])


def test_on_a_directory_nothing_is_pinned(tmp_path):
    decision = _decided(str(tmp_path / "bucket"))
    assert not RoundBucket(str(tmp_path / "bucket"), 0, 2).keeps_versions() and decision.versions == {}


# ------------------------------------------------------------------------------------------- a malformed versions field
@pytest.mark.parametrize("versions", [None, [], "v1", {}, {"0": "v1"}, {"1": "v1", "0": "v2"}, {"1": 7},
                                      {"1": ""}, {"1": "a b"}, {"1": "v1\n"}, {"1": "../x?y"}, {"1": "a" * 257}])
def test_a_decision_with_a_malformed_versions_field_is_refused(tmp_path, versions):
    bucket = tmp_path / "bucket"
    (bucket / "rounds").mkdir(parents=True)
    record = {"round": 1, "members": [1], "digests": {"1": "a" * 64}, "closed_by": 1, "reason": "all"}
    (bucket / "rounds" / "00000001.json").write_text(json.dumps({**record, "versions": versions}))
    (bucket / "rounds" / "00000002.json").write_text(json.dumps({**record, "round": 2, "versions": {"1": "a" * 256}}))
    with pytest.raises(RefusedDelta, match="not what rlvr writes"):
        RoundBucket(str(bucket), 0, 2).decision(1)
    assert RoundBucket(str(bucket), 0, 2).decision(2).versions == {1: "a" * 256}  # at the bound: accepted


def test_a_slow_learner_applies_a_delta_replaced_after_its_round_as_decided(versioned_url):
    """Through a learner's round logic: round 1 decided on learners 0 and 1 (deltas 0.1 and 0.2), then learner 1's
    delta replaced by 0.9 before a slow learner read it. The slow learner's outer step still averages the decided
    0.1 and 0.2 (the documented Nesterov step from START, by hand), neither stopping nor splitting from the others."""
    from rlvr.core.outer import nesterov_step, outer_gradient
    from tests.test_hostile_bucket import START, _update

    decision = _decided(versioned_url, members=(0, 1))
    RoundBucket(versioned_url, 1, 2).publish_delta(1, _delta(0.9), {})
    slow = _update(versioned_url)
    weights, _, averaged, _ = slow._outer_step(1, decision, START, None, LIKE)
    expected = nesterov_step(START, outer_gradient([_delta(0.1), _delta(0.2)]), None, 0.7, 0.9)[0]
    assert averaged == 2 and all(torch.equal(weights[k], expected[k]) for k in LIKE)
