"""A hostile writer of a DiLoCo / shared-rollouts bucket costs the others its own share, never their run: a link at any
level below the bucket is never followed (reads, writes, gc); a delta a decision pins but no learner can read is
dropped by every learner alike; a replaced start of the job is refused; forged behaviour log-probs under
ratio_to=behaviour move a learner no more than the cap allows; a peer that is late or refused is not waited for every
step. Unit level: no training run (docs/concepts/diloco.md, docs/concepts/shared_rollouts.md)."""

import copy
import hashlib
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save

from rlvr.store.bucket import AdapterBucket, ManifestError
from rlvr.store.rounds import Decision, RefusedDelta, RoundBucket
from rlvr.store.shared_groups import GroupBucket, RefusedGroups
from tests.test_hostile_bucket import LIKE, START, _delta, _update
from tests.test_shared_rollouts import LIMITS, _peer_groups, _receiver, _shared


# ------------------------------------------------------------------------------- links one level up (class 6)
@pytest.mark.parametrize("linked", ["learner-0001", "global", "rollouts/learner-0001", "rollouts"])
def test_a_linked_directory_below_the_bucket_is_never_read_written_or_collected(tmp_path, linked):
    """A peer replaces a directory of the layout by a link to one outside the bucket that holds valid versions: a
    learner reads nothing through it, writes nothing through it, and gc deletes nothing through it."""
    bucket, outside = tmp_path / "bucket", tmp_path / "outside"
    (outside / "rollouts").mkdir(parents=True)
    RoundBucket(str(outside), 1, 2).publish_delta(1, _delta(0.1), {})  # valid versions, outside
    RoundBucket(str(outside), 1, 2).publish_state(0, START, None, {})
    for step in range(1, 4):
        GroupBucket(str(outside), 1, 2).publish(_shared(step=step))
    before = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    (bucket / linked).parent.mkdir(parents=True, exist_ok=True)
    (bucket / linked).symlink_to(outside / linked, target_is_directory=True)
    if linked == "learner-0001":
        with pytest.raises(RefusedDelta, match="outside the bucket"):
            RoundBucket(str(bucket), 0, 2).read_delta(1, 1, LIKE, torch.float32)
        with pytest.raises(ManifestError, match="outside the bucket"):  # learner 1's own publish, planted
            RoundBucket(str(bucket), 1, 2).publish_delta(2, _delta(0.1), {})
        RoundBucket(str(bucket), 1, 2)._learner_bucket(1).gc(0)
    elif linked == "global":
        with pytest.raises(RefusedDelta, match="outside the bucket"):
            RoundBucket(str(bucket), 0, 2).read_state(0, LIKE)
        with pytest.raises(ManifestError, match="outside the bucket"):
            AdapterBucket(f"{bucket}/global", within=bucket).publish_files(5, {"adapter_model.safetensors": b"x",
                                                                                "adapter_config.json": b"{}"})
        assert AdapterBucket(f"{bucket}/global", within=bucket).gc(0) == []
    else:
        with pytest.raises(RefusedGroups, match="outside the bucket"):
            GroupBucket(str(bucket), 0, 2).read(1, 3, LIMITS)
        with pytest.raises(ManifestError, match="outside the bucket"):  # learner 1's own publish, planted
            GroupBucket(str(bucket), 1, 2).publish(_shared(step=4))
        GroupBucket(str(bucket), 1, 2).gc(0)
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == before  # nothing made or deleted


# ---------------------------------------------------------------------- a refused pinned delta (class 5)
def _hostile_decision(bucket, link: bool) -> Decision:
    """Learner 0 publishes a valid delta; learner 1 (hostile) decides round 1 itself, pinning its own delta - a
    version linked outside the bucket (no learner may read it) or one that is NaN (refused on its bytes)."""
    RoundBucket(str(bucket), 0, 2).publish_delta(1, _delta(0.1), {})
    digests = {0: RoundBucket(str(bucket), 0, 2).read_delta(1, 0, LIKE, torch.float32)[1]}
    outside = bucket.parent / "outside"
    hostile = _delta(float("nan")) if not link else _delta(0.3)
    RoundBucket(str(outside if link else bucket), 1, 2).publish_delta(1, hostile, {})
    if link:
        (bucket / "learner-0001").mkdir()
        (bucket / "learner-0001" / "v00000001").symlink_to(outside / "learner-0001" / "v00000001")
    payload = (outside if link else bucket) / "learner-0001" / "v00000001" / "adapter_model.safetensors"
    digests[1] = hashlib.sha256(payload.read_bytes()).hexdigest()
    decision = Decision(1, (0, 1), digests, 1, "all")
    RoundBucket(str(bucket), 1, 2).decide(decision)
    return decision


@pytest.mark.parametrize("link", [True, False])
def test_a_pinned_delta_no_learner_can_use_costs_its_share_never_the_run(tmp_path, link):
    """Before: the honest learner waited round_timeout_s and stopped (rc 2). Now every learner drops the hostile
    member and applies the honest one: the same weights on both, the round's step that of learner 0's delta alone."""
    bucket = tmp_path / "bucket"
    decision = _hostile_decision(bucket, link)
    first, second = _update(bucket), _update(bucket)  # round_timeout_s = 0.5
    a, _, averaged, _ = first._outer_step(1, decision, START, None, LIKE)
    b, _, _, _ = second._outer_step(1, decision, START, None, LIKE)
    from rlvr.core.outer import nesterov_step, outer_gradient

    expected = nesterov_step(START, outer_gradient([_delta(0.1)]), None, 0.7, 0.9)[0]
    assert averaged == 1 and first.totals["refused"] == 1
    assert all(torch.equal(a[k], expected[k]) and torch.equal(b[k], expected[k]) for k in LIKE)


def test_a_delta_given_up_on_by_one_learner_is_dropped_by_all_even_once_readable(tmp_path):
    """Availability differs between learners (a peer can link and unlink): the first verdict counts for everyone,
    so no two learners apply different deltas. Learner A gives up on the linked delta; the peer then restores a
    readable copy; learner B still drops it."""
    bucket = tmp_path / "bucket"
    decision = _hostile_decision(bucket, link=True)
    a = _update(bucket)._outer_step(1, decision, START, None, LIKE)[0]
    version = bucket / "learner-0001" / "v00000001"
    version.unlink()
    shutil.copytree(tmp_path / "outside" / "learner-0001" / "v00000001", version)  # now inside, and readable
    assert RoundBucket(str(bucket), 0, 2).read_delta(1, 1, LIKE, torch.float32, decision.digests[1])
    b = _update(bucket)._outer_step(1, decision, START, None, LIKE)[0]
    assert all(torch.equal(a[k], b[k]) for k in LIKE)


# --------------------------------------------------------------------------- the job's start (class 7)
def test_a_replaced_start_is_refused_on_every_read(tmp_path):
    """global/v00000000 replaced by other (valid, finite) weights: a resuming or joining learner would have taken
    them and split the job; the digest job.json recorded refuses them in one line."""
    from rlvr.store.rounds import state_digest

    bucket = RoundBucket(str(tmp_path), 0, 2)
    bucket.job({"learners": 2, "start": state_digest(START)})
    bucket.publish_state(0, START, None, {"reason": "start"})
    update = _update(tmp_path)
    assert all(torch.equal(update._job_start(LIKE)[k], START[k]) for k in LIKE)
    forged = {k: torch.full_like(v, 7.0) for k, v in LIKE.items()}
    bucket.global_.publish_files(0, {"adapter_model.safetensors": save(forged), "adapter_config.json": b"{}"})
    with pytest.raises(RefusedDelta, match="global/v00000000/adapter_model.safetensors is not the job's start.*"
                                           "Restore it"):
        update._job_start(LIKE)


# --------------------------------------------------------------- forged log-probs, ratio_to=behaviour (class 8)
def _behaviour_update(trainer, round_, lr=0.3):
    """One sequence-mean SGD step with ratio_to=behaviour (no importance weight: the ratio is the correction)."""
    from rlvr.core import LossSettings
    from rlvr.learn.batch import StepBatch
    from rlvr.learn.learner import Learner
    from rlvr.learn.step import StepOptions, train_step
    from rlvr.run.collect import group_advantage_fn

    adv = group_advantage_fn(4, "group", 1e-4, 1.0)(round_.scores).double()
    batch = StepBatch.from_groups(round_.groups, adv)
    model = copy.deepcopy(trainer)
    settings = replace(LossSettings(), ratio_to="behaviour", is_level="none")
    train_step(Learner(model, torch.optim.SGD(model.parameters(), lr=lr)), batch, settings,
               StepOptions(micro_batch_size=8, max_completion_tokens=8, max_grad_norm=0.0))
    return model, batch


def test_forged_log_probs_under_ratio_to_behaviour_move_a_learner_no_more_than_the_cap(tokenizer):
    """A peer claims log-prob -50 for every token. With ratio_to=behaviour the loss is -min(r A, clip(r) A) with
    r = pi_theta / mu and no weight: r ~ e^45, and a token with A < 0 pulls with r |A|. The receiver floors mu at
    its own log-prob - log C (C = is_cap = 2), so r = C pi_theta / pi_theta0 = 2 at the step's start. By hand:
    A > 0: min(2A, 1.2A) = 1.2A, a constant (no gradient); A < 0: min(2A, 1.2A) = 2A, so the loss is
    -2A pi_theta / sg[pi_theta] - the update of a group whose every token weighs exactly C, and no more."""
    from rlvr.run.shared_rollouts import Receiver, policy_logprobs
    from tests.test_off_policy import _assert_same_weights, _expected_update

    shared, trainer, _ = _peer_groups(tokenizer, forged_logp=-50.0)
    plain = _receiver(tokenizer)
    receiver = Receiver(plain.rows, tokenizer, plain.rewards, plain.limits, sorted(plain.eos), (), 1.0,
                        own_logp=policy_logprobs(trainer), is_cap=2.0)
    round_, _, _ = receiver.rebuilt(shared)
    model, batch = _behaviour_update(trainer, round_)

    def at_the_cap(logp, mu, adv):  # [N, T]
        return torch.where(adv < 0, -2.0 * adv * torch.exp(logp - logp.detach()), 0.0 * logp)

    _assert_same_weights(model, _expected_update(trainer, batch, at_the_cap, lr=0.3))
    unfloored, _ = _behaviour_update(trainer, plain.rebuilt(shared)[0])  # what it did without the floor
    with torch.no_grad():
        moved = max(float((p - q).abs().max()) for p, q in zip(unfloored.parameters(), trainer.parameters()))
        capped = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), trainer.parameters()))
    assert moved > 1e6 * capped > 0


# -------------------------------------------------------------------------- late and refused peers (class 9)
class _Peers:
    """A bucket whose peer (learner 1) publishes, per step: 'ok', 'refused' or nothing (None)."""

    def __init__(self, plan: dict[int, str | None]):
        self.plan = plan

    def arrived(self, step: int) -> list[int]:
        return [1] if self.plan.get(step) else []

    def read(self, k, step, limits):
        if self.plan[step] == "refused":
            raise RefusedGroups(f"learner {k}'s groups of step {step}: forged")
        return _shared(step=step, row_ids=torch.tensor([1, 3])), 100


def _source(plan: dict[int, str | None], bucket):
    from rlvr.run.shared_rollouts import SharingSource

    d = SimpleNamespace(learner="0/2", bucket=str(bucket), rollouts="step", rollout_timeout_s=0.05)
    cfg = SimpleNamespace(diloco=d, train=SimpleNamespace(prompts_per_step=2))
    source = SharingSource(SimpleNamespace(label="sync", share=None, rounds_reserved=lambda: 1), cfg)
    source.bucket, source.receiver = _Peers(plan), SimpleNamespace(limits=LIMITS)
    source._allowed_rows = lambda k, cursor: None  # any row of its shard (k modulo K)
    return source


def test_a_late_or_refused_peer_is_not_waited_for_every_step(tmp_path):
    """Learner 1 alternates a refused step and an absent one: before, every absent step waited rollout_timeout_s
    (a refused peer stayed awaited); now it is waited for once it has been on time and valid for as many steps as
    it missed or was refused. Counted in waits (missed deadlines), never timed."""
    plan = {s: ("refused" if s % 2 else None) for s in range(1, 9)}  # refused, absent, refused, absent, ...
    plan.update({9: "ok", 10: "ok", 11: "ok", 12: "ok", 13: None, 14: "ok"})
    source = _source(plan, tmp_path)
    run = SimpleNamespace(stop_requested=False)
    waits = []
    for step in range(1, 15):
        before = source.totals["missed"]
        got = source._gather_step(run, step, 0)
        waits.append(int(source.totals["missed"] - before))
        assert len(got) == (plan[step] == "ok")  # a valid peer's groups are trained whenever they are there
    # refused at 1, 3, 5, 7 (4 strikes; absent at 2, 4, 6, 8 and not awaited: no wait); on time and valid at
    # 9-12 (4 steps): awaited again at 13, where it misses the deadline - one wait in 14 steps, where it was 5
    assert waits == [0] * 12 + [1, 0]
