"""Attested snapshots of a DiLoCo job's weights: how a learner that joins, resumes or comes back late starts from the
swarm's current weights in a bounded number of reads, instead of replaying every decided round's deltas.

    learner-0003/attest-00000012.json   {"round": 12, "weights": SHA-256, "momentum": SHA-256 or null}
                                        created once by learner 3, after it computed round 12's weights itself

The weights after round R (global/vR, momentum/vR) are one writer's files, and no reader takes them on trust: a
snapshot is taken only when more than half of round R's members (its decision names them) attest the same digests,
and the bytes read are checked against those digests. Each learner attests under its own prefix, which a store can
keep other learners from writing (docs/concepts/diloco.md, "An object store as the bucket"); on a bucket where every
learner may write everywhere, a majority of a round's members forging one snapshot can give a joiner other weights
(as a majority of its deltas could move the others). Reads: the round's decision, at most one attestation per
member, two payloads.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import torch

from rlvr.store.bucket import ManifestError
from rlvr.store.rounds import RefusedDelta, RoundBucket, state_digest

Tensors = dict[str, torch.Tensor]


def _digest(value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def _name(round_: int) -> str:
    return f"attest-{round_:08d}.json"


def attest(bucket: RoundBucket, round_: int, weights: Tensors, momentum: Tensors | None) -> None:
    """Record, under this learner's prefix, the digests of the weights (and momentum) it computed after ``round_``
    (created once: a resumed learner that closes the same round again finds it there). A refused write costs
    nothing but this learner's vote."""
    record = {"round": round_, "weights": state_digest(weights),
              "momentum": None if momentum is None else state_digest(momentum)}
    try:
        bucket.create_file(f"{bucket.root}/learner-{bucket.learner:04d}/{_name(round_)}", json.dumps(record).encode())
    except (ManifestError, OSError) as err:
        print(f"rlvr: diloco: could not attest round {round_}'s weights: {err}", flush=True)


def attested(bucket: RoundBucket, round_: int, members: tuple[int, ...]) -> tuple[str, str | None] | None:
    """The (weights, momentum) digests that more than half of ``members`` attest for ``round_``; None otherwise."""
    votes: Counter = Counter()
    for k in members:
        try:
            record = bucket.read_record(f"{bucket.root}/learner-{k:04d}", _name(round_),
                                   f"learner {k}'s attestation of round {round_}")
        except RefusedDelta:
            continue
        if record is None or record.get("round") != round_:
            continue
        weights, momentum = record.get("weights"), record.get("momentum")  # momentum absent: none, as null
        if _digest(weights) and (momentum is None or _digest(momentum)):
            votes[(weights, momentum)] += 1
    if not votes:
        return None
    best, count = votes.most_common(1)[0]
    return best if count > len(members) // 2 else None


def snapshot(bucket: RoundBucket, round_: int, like: Tensors) -> tuple[Tensors, Tensors | None] | None:
    """(weights, momentum) after ``round_`` when a majority of its members attest them and the bytes are those;
    None when the round has no decision, no members, no majority or no such files (the caller replays instead)."""
    try:
        decision = bucket.decision(round_)
    except RefusedDelta:
        return None
    if decision is None or not decision.members:
        return None
    digests = attested(bucket, round_, decision.members)
    if digests is None:
        return None
    try:
        weights, momentum = bucket.read_state(round_, like, digests[0])
    except RefusedDelta:
        return None
    held = None if momentum is None else state_digest(momentum)
    if held != digests[1]:  # the momentum file missing, or not the attested one
        return None
    return weights, momentum
