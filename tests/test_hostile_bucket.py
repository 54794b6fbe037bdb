"""A peer with write access to a DiLoCo bucket, playing the other learners by the documented layout: it cannot make a
learner write outside the bucket, read through a link, hang on a decision, take weights no decision gives, go on with
weights the others do not hold, or spread a non-finite or outsized step (docs/security.md, "Untrusted deltas")."""

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

from rlvr.config.loading import load_config
from rlvr.core.outer import nesterov_step, outer_gradient
from rlvr.run.diloco import DilocoUpdate
from rlvr.store.bucket import AdapterBucket, ManifestError
from rlvr.store.rounds import Decision, RefusedDelta, RoundBucket

LIKE = {"layer.lora_A.weight": torch.zeros(2, 3), "layer.lora_B.weight": torch.zeros(3, 2)}
START = {k: torch.full_like(v, 0.5) for k, v in LIKE.items()}


def _delta(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in LIKE.items()}


def _files(value: float = 0.1) -> dict[str, bytes]:
    from safetensors.torch import save

    return {"adapter_model.safetensors": save(_delta(value)), "adapter_config.json": b"{}"}


def _update(bucket, *extra: str) -> DilocoUpdate:
    """Learner 0 of 2 of a job on ``bucket`` (its round logic alone: no model)."""
    cfg = load_config(None, ["diloco.learner=0/2", f"diloco.bucket={bucket}", "diloco.round_timeout_s=0.5", *extra])
    return DilocoUpdate(SimpleNamespace(needs_reference=False), cfg)


# --------------------------------------------------------------------------------------- writers never follow links
@pytest.mark.parametrize("planted", ["version_dir", "payload", "manifest", "fifo"])
def test_a_publish_never_writes_through_a_planted_link_or_into_a_fifo(tmp_path, planted):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_model.safetensors").write_bytes(b"precious")
    bucket = tmp_path / "bucket"
    version = bucket / "v00000001"
    if planted == "version_dir":
        bucket.mkdir()
        version.symlink_to(outside, target_is_directory=True)
    else:
        version.mkdir(parents=True)
        name = {"payload": "adapter_model.safetensors", "manifest": "manifest.json", "fifo": "adapter_config.json"}
        if planted == "fifo":
            os.mkfifo(version / name[planted])
        else:
            (version / name[planted]).symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(ManifestError, match="outside the bucket|symlink or not a regular file"):
        AdapterBucket(bucket).publish_files(1, _files())
    assert (outside / "adapter_model.safetensors").read_bytes() == b"precious"
    assert sorted(p.name for p in outside.iterdir()) == ["adapter_model.safetensors"]


def test_a_decision_is_never_written_through_a_linked_rounds_directory(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "bucket").mkdir()
    (tmp_path / "bucket" / "rounds").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ManifestError, match="outside the bucket"):
        RoundBucket(str(tmp_path / "bucket"), 0, 2).decide(Decision(1, (0,), {0: "a" * 64}, 0, "all"))
    assert list(outside.iterdir()) == []


# --------------------------------------------------------------------------------------------- readers and waits
def test_a_version_directory_linked_outside_the_bucket_is_not_read(tmp_path):
    elsewhere = AdapterBucket(tmp_path / "elsewhere")
    elsewhere.publish_files(1, _files())  # a complete, valid version - outside the bucket
    bucket = tmp_path / "bucket" / "learner-0001"
    bucket.mkdir(parents=True)
    (bucket / "v00000001").symlink_to(tmp_path / "elsewhere" / "v00000001", target_is_directory=True)
    with pytest.raises(RefusedDelta, match="outside the bucket"):
        RoundBucket(str(tmp_path / "bucket"), 0, 2).read_delta(1, 1, LIKE, torch.float32)


@pytest.mark.parametrize("kind", ["half_written", "json_list", "fifo", "link_to_fifo", "learner_9_of_2"])
def test_a_decision_that_cannot_be_read_drops_the_round_at_the_timeout_never_hangs(tmp_path, kind):
    rounds = tmp_path / "bucket" / "rounds"
    rounds.mkdir(parents=True)
    path = rounds / "00000001.json"
    if kind == "half_written":
        path.write_text("{")
    elif kind == "json_list":  # JSON, but not an object: read as one, it raised AttributeError
        path.write_text("[1, 2]")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link_to_fifo":
        os.mkfifo(tmp_path / "fifo")
        path.symlink_to(tmp_path / "fifo")
    else:
        path.write_text(json.dumps({"round": 1, "members": [9], "digests": {"9": "a" * 64}, "closed_by": 9,
                                    "reason": "all"}))
    with pytest.raises(RefusedDelta):
        RoundBucket(str(tmp_path / "bucket"), 0, 2).decision(1)
    update = _update(tmp_path / "bucket")
    started = time.monotonic()
    decision = update._wait_for_decision(1, LIKE)
    assert time.monotonic() - started < 5  # round_timeout_s = 0.5
    assert decision.members == () and decision.reason == "unreadable" and update.totals["refused_rounds"] == 1


def test_a_stop_request_ends_the_wait_with_the_round_left_open(tmp_path):
    update = _update(tmp_path / "bucket", "diloco.round_timeout_s=600")
    update.run = SimpleNamespace(stop_requested=True)  # SIGTERM arrived while the learner waits
    started = time.monotonic()
    assert update._wait_for_decision(1, LIKE) is None and time.monotonic() - started < 1


# ------------------------------------------------------------------------------------------ what a learner takes
def _two_deltas(bucket) -> Decision:
    """Learners 0 and 1 publish round 1's deltas (0.1 and 0.2 everywhere); learner 1 decides on both."""
    digests = {}
    for k in (0, 1):
        RoundBucket(str(bucket), k, 2).publish_delta(1, _delta(0.1 * (k + 1)), {})
        digests[k] = RoundBucket(str(bucket), 0, 2).read_delta(1, k, LIKE, torch.float32)[1]
    decision = Decision(1, (0, 1), digests, 1, "all")
    RoundBucket(str(bucket), 1, 2).decide(decision)
    return decision


def test_shared_weights_no_decision_gives_are_never_taken(tmp_path):
    """global/v1 holds weights of the peer's choosing and global/v7 has no decision at all: a learner replays round
    1 from its decision and deltas, reports the published weights and ignores them; the job is at round 1."""
    bucket = RoundBucket(str(tmp_path), 1, 2)
    bucket.publish_state(0, START, None, {"reason": "start"})
    _two_deltas(tmp_path)
    forged = {k: torch.full_like(v, 1e6) for k, v in LIKE.items()}
    bucket.publish_state(1, forged, None, {})
    bucket.publish_state(7, forged, None, {})
    assert bucket.decided() == 1 and bucket.latest_state() == 7
    update = _update(tmp_path)
    weights, momentum = update._replay(1, 1, START, None, LIKE)
    expected, expected_momentum = nesterov_step(START, outer_gradient([_delta(0.1), _delta(0.2)]), None, 0.7, 0.9)
    assert all(torch.equal(weights[k], expected[k]) for k in LIKE) and update.totals["refused"] == 1
    assert all(torch.equal(momentum[k], expected_momentum[k]) for k in LIKE)


def test_a_delta_replaced_after_its_round_was_decided_stops_every_learner_alike(tmp_path):
    """One learner applied the decided bytes; the peer then replaces them. Another learner cannot compute what the
    first holds: it waits round_timeout_s for the pinned bytes, then stops in one line - never going on apart."""
    decision = _two_deltas(tmp_path)
    applied = _update(tmp_path)._outer_step(1, decision, START, None, LIKE)[0]
    RoundBucket(str(tmp_path), 1, 2).publish_delta(1, _delta(0.25), {})  # replaced after the decision
    with pytest.raises(RefusedDelta, match="changed after the round's decision.*Restore that delta"):
        _update(tmp_path)._outer_step(1, decision, START, None, LIKE)
    assert all(torch.isfinite(t).all() for t in applied.values())


@pytest.mark.parametrize("settings, bounded", [([], True), (["diloco.max_delta_ratio=0"], False)])
def test_a_huge_finite_delta_is_bounded_by_default_and_a_non_finite_step_is_refused(tmp_path, settings, bounded):
    """3e38 per entry is finite (float32 ends at 3.4e38), but two of them overflow the outer step's sum: by default
    each is scaled to |start| before averaging; with no bound at all, the step is refused (the round dropped) rather
    than spread as inf."""
    digests = {}
    for k, value in ((0, 3e38), (1, 3e38)):
        RoundBucket(str(tmp_path), k, 2).publish_delta(1, _delta(value), {})
        digests[k] = RoundBucket(str(tmp_path), 0, 2).read_delta(1, k, LIKE, torch.float32)[1]
    update = _update(tmp_path, *settings)
    weights, _, averaged, scaled = update._outer_step(1, Decision(1, (0, 1), digests, 0, "all"), START, None, LIKE)
    assert all(torch.isfinite(t).all() for t in weights.values())
    if bounded:
        assert averaged == 2 and scaled == 2  # each to the norm of START
        assert max(float(t.abs().max()) for t in weights.values()) < 10
    else:
        assert averaged == 0 and update.totals["refused_rounds"] == 1
        assert all(torch.equal(weights[k], START[k]) for k in LIKE)  # dropped: the round's start
