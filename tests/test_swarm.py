"""Learners that come and go (rollouts=recent with weight rounds, docs/concepts/swarm.md), counted: a reader
killed mid-step and resumed trains each peer step's groups once; a learner suspended (SIGSTOP) for the whole of a
peer's run never stalls it past one round's timeout and, continued, applies every decided round once (its weights
and the peer's are the decisions replayed by hand); a joiner starts from an attested snapshot, reading no delta and
no object of an older round, on the S3 server. Real learners: the tiny model, forked or in this process."""

import os
import signal
import time

import torch
from safetensors.torch import load_file

from rlvr.store.rounds import RoundBucket
from rlvr.store.shared_groups import GroupBucket, SharedGroups
from tests.test_resume import (
    _tail,
    fork_server,  # noqa: F401 (an autouse module fixture: the fork server starts early)
    join_forked,
    start_forked_train,
    train_killed,
)
from tests.test_shared_rollouts import _adapter, _learner, _metrics, _train_here

pytest_plugins = ["tests.s3_server"]  # the moto server, the proxy and the s3_url fixtures

RECENT = ["diloco.rollouts=recent", "diloco.outer_lr=1.0", "diloco.outer_momentum=0"]


def _peer_step(bucket, step: int, vocab: int) -> None:
    """Learner 1's one group (row 1, four completions of 1, 2, 4 and 6 tokens: four rewards under length_reward)
    of ``step``, as an honest learner publishes it."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.tensor([1, 2, 4, 6], dtype=torch.int32)
    ids = torch.randint(3, vocab, (4, 6), generator=g, dtype=torch.int32)
    mask = torch.arange(6)[None, :] < lengths[:, None]
    GroupBucket(str(bucket), 1, 2).publish(SharedGroups(
        learner=1, step=step, version=step - 1, group_size=4, row_ids=torch.tensor([1]),
        completion_ids=ids.masked_fill(~mask, 0), lengths=lengths,
        behaviour_logp=(-torch.rand(4, 6, generator=g) - 0.1).masked_fill(~mask, 0.0), rewards=torch.zeros(4)))


def _taken(run) -> list[float]:
    """The peers' groups each step of the run's history trained on (metrics.jsonl keeps only the steps a resumed run
    continued from: those redone after a kill are rewritten)."""
    return [r["shared/external_groups"] for r in _metrics(run) if "shared/external_groups" in r]


def test_a_reader_killed_mid_step_and_resumed_trains_each_peer_step_once(tiny_model_dir, tokenizer, tmp_path):
    """Peer steps 1-5 are there at the start: step 1 takes 3, 4 and 5 (the newest three, rollout_max_age=3). The
    reader is SIGKILLed after step 2's update, before its checkpoint; steps 6 and 7 appear meanwhile. Resumed from
    step 1's checkpoint (which holds what it had taken), step 2 takes 6 and 7: five groups in all, each once, and
    never 1 or 2 (too old when first seen). Without the checkpointed cursor the resumed step 2 would take 5 again."""
    bucket, out, V = tmp_path / "bucket", tmp_path / "l0", len(tokenizer)
    for step in range(1, 6):
        _peer_step(bucket, step, V)
    args = [*RECENT, "diloco.inner_steps=0", "diloco.rollout_max_age=3", "diloco.external_groups=8",
            "train.checkpoint_every=1"]
    code = train_killed(_learner(out, tiny_model_dir, bucket, 0, *args),
                        "after_update@2", tmp_path / "killed.log")
    assert code == -9, _tail(tmp_path / "killed.log")
    assert _taken(out) == [3]  # step 1 logged and checkpointed; step 2 died with the process
    for step in (6, 7):
        _peer_step(bucket, step, V)
    _train_here(_learner(out, tiny_model_dir, bucket, 0, *args, "resume=auto"))
    assert _taken(out) == [3, 2, 0, 0]
    last = _metrics(out)[-1]
    assert last["shared/total_refused"] == 0 and last["shared/total_rescored_flat"] == 0


def _decided_weights(bucket, learners: int) -> tuple[list, list[dict]]:
    """Every decision in the bucket and the weights after each, computed by hand from the start: outer lr 1 and
    momentum 0 make a round theta + the mean of its members' deltas (one member: theta + its delta)."""
    b = RoundBucket(str(bucket), 0, learners)
    theta = load_file(str(bucket / "global" / "v00000000" / "adapter_model.safetensors"))
    decisions, after = [], []
    for path in sorted((bucket / "rounds").glob("*.json")):
        decision = b.decision(int(path.stem))
        deltas = [load_file(str(bucket / f"learner-{k:04d}" / f"v{decision.round:08d}" / "adapter_model.safetensors"))
                  for k in decision.members]
        if deltas:
            theta = {n: t + sum(d[n] for d in deltas) / len(deltas) for n, t in theta.items()}
        decisions.append(decision)
        after.append(theta)
    return decisions, after


def test_a_suspended_learner_stalls_nobody_and_continued_applies_every_round_once(tiny_model_dir, tmp_path):
    """Learner 1 (forked) is SIGSTOPped as soon as it has joined, for the whole of learner 0's six steps (three
    rounds of two): learner 0 waits for it once (round 1 closes at the 2 s timeout without it), then never again.
    Continued, learner 1 finds its round decided without it (late, counted), starts from round 3's attested
    snapshot, and closes rounds 4 and 5 alone. Both end on exactly the weights the decisions give by hand."""
    bucket, log = tmp_path / "bucket", tmp_path / "l1.log"
    args = [*RECENT, "diloco.inner_steps=2", "diloco.round_timeout_s=2", "train.steps=6"]
    other = start_forked_train(_learner(tmp_path / "l1", tiny_model_dir, bucket, 1, *args), "", log)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "l1" / "diloco.json").is_file():  # joined: round 1, nothing published yet
            assert other.is_alive() and time.monotonic() < deadline, _tail(log)
            time.sleep(0.02)
        os.kill(other.pid, signal.SIGSTOP)
        _train_here(_learner(tmp_path / "l0", tiny_model_dir, bucket, 0, *args))
    finally:
        if other.pid is not None and other.is_alive():
            os.kill(other.pid, signal.SIGCONT)
    assert join_forked(other) == 0, _tail(log)
    decisions, after = _decided_weights(bucket, 2)
    assert [(d.round, d.members, d.reason) for d in decisions] == [
        (1, (0,), "timeout"), (2, (0,), "all"), (3, (0,), "all"), (4, (1,), "timeout"), (5, (1,), "all")]
    for run, index in (("l0", 2), ("l1", 4)):  # learner 0 ended after round 3, learner 1 after round 5
        held = _adapter(tmp_path / run)  # saved as PEFT names them: without the adapter's name, "default"
        expected = {n.replace(".default.", "."): t for n, t in after[index].items()}
        assert held.keys() == expected.keys() and all(torch.equal(held[n], expected[n]) for n in held), run
    outer = {run: {k.removeprefix("update/outer_"): v for k, v in _metrics(tmp_path / run)[-1].items()
                   if k.startswith("update/outer_")} for run in ("l0", "l1")}
    assert outer["l0"]["rounds"] == 3 and outer["l0"]["late"] == 0
    assert outer["l1"]["rounds"] == 3 and outer["l1"]["late"] == 1 and outer["l1"]["snapshots"] == 1


def test_a_joiner_reads_a_snapshot_not_the_history_on_the_store(tiny_model_dir, s3_url, proxy, tmp_path):
    """Learner 0 of 2 runs six rounds alone on the S3 server (round 1 closes at the timeout, the rest at once).
    A fresh learner 1 joins (diloco.join=true) through the proxy, which sees every request: it reads round 6's
    attested snapshot and nothing of rounds 1-5 - no delta, no older weights - and its own round is round 7."""
    args = ["diloco.outer_lr=1.0", "diloco.outer_momentum=0", "diloco.inner_steps=1", "diloco.round_timeout_s=1"]
    _train_here(_learner(tmp_path / "l0", tiny_model_dir, s3_url, 0, *args, "train.steps=6"))
    start = len(proxy.seen)
    _train_here(_learner(tmp_path / "l1", tiny_model_dir, s3_url, 1, *args, "train.steps=1", "diloco.join=true"))
    read = {path.split("?")[0] for method, path, _ in proxy.seen[start:] if method == "GET" and "list-type" not in path}
    job = s3_url.removeprefix("s3://")
    older = [p for p in read if any(f"{part}/v0000000{r}" in p or f"rounds/0000000{r}." in p
                                    for r in range(1, 6) for part in ("global", "momentum", "learner-0000"))]
    assert not older, older
    assert f"/{job}/global/v00000006/adapter_model.safetensors" in read  # the snapshot, checked against its attestation
    assert f"/{job}/learner-0000/attest-00000006.json" in read
    outer = {k.removeprefix("update/outer_"): v for k, v in _metrics(tmp_path / "l1")[-1].items()
             if k.startswith("update/outer_")}
    assert outer["snapshots"] == 1 and outer["rounds"] == 1
    assert RoundBucket(s3_url, 0, 2).decision(7).members == (1,)


def test_a_snapshot_needs_a_majority_of_well_formed_attestations(tmp_path):
    """Round 1's members are 0, 1 and 2. Learner 0 attests (w, no momentum) with momentum null, learner 1 the same
    with the momentum key left out (read as none), learner 2 other weights: two of three agree, so (w, None) is the
    snapshot's. With learner 1's attestation not JSON, or naming another round, there is no majority."""
    import json

    from rlvr.store.rounds import Decision
    from rlvr.store.snapshots import attested

    bucket, w, other = RoundBucket(str(tmp_path), 0, 3), "a" * 64, "b" * 64
    bucket.decide(Decision(1, (0, 1, 2), {k: "c" * 64 for k in range(3)}, 0, "all"))

    def vote(k: int, raw: bytes) -> None:
        path = tmp_path / f"learner-{k:04d}" / "attest-00000001.json"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(raw)

    vote(0, json.dumps({"round": 1, "weights": w, "momentum": None}).encode())
    vote(1, json.dumps({"round": 1, "weights": w}).encode())
    vote(2, json.dumps({"round": 1, "weights": other, "momentum": None}).encode())
    assert attested(bucket, 1, (0, 1, 2)) == (w, None)
    for forged in (b"not json", json.dumps({"round": 2, "weights": w}).encode(),
                   json.dumps({"round": 1, "weights": w, "momentum": 7}).encode()):
        vote(1, forged)
        assert attested(bucket, 1, (0, 1, 2)) is None
