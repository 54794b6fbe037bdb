"""Learners that share scored groups through their bucket (diloco.rollouts). A shared group round-trips exactly;
what a hostile learner writes is refused, re-scored or capped (each case); the importance weight of an external
completion is the formula by hand; real learners (tiny model, LoRA) on a loopback directory train on each other's
groups - under rollouts=step they end on the same weights, those of one learner at twice the batch."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from rlvr.store.bucket import AdapterBucket
from rlvr.store.shared_groups import FIELDS, GroupBucket, GroupLimits, RefusedGroups, SharedGroups
from tests.test_resume import (
    _tail,
    fork_server,  # noqa: F401 (an autouse module fixture: the fork server starts early)
    join_forked,
    start_forked_train,
)

ROOT = Path(__file__).resolve().parent.parent
LIMITS = GroupLimits(max_groups=4, group_size=2, max_tokens=5, vocab=100, rows=10)


def _shared(learner: int = 1, step: int = 3, **changes) -> SharedGroups:
    """Two groups of 2 completions (lengths 3, 1, 5, 2) of rows 1 and 7."""
    lengths = torch.tensor([3, 1, 5, 2], dtype=torch.int32)
    mask = torch.arange(5)[None, :] < lengths[:, None]
    ids = (torch.arange(20, dtype=torch.int32).view(4, 5) + 1).masked_fill(~mask, 0)
    logp = (-torch.rand(4, 5, generator=torch.Generator().manual_seed(0)) - 0.01).masked_fill(~mask, 0.0)
    fields = {"learner": learner, "step": step, "version": step - 1, "group_size": 2, "row_ids": torch.tensor([1, 7]),
              "completion_ids": ids, "lengths": lengths, "behaviour_logp": logp,
              "rewards": torch.tensor([1.0, 0.0, 0.5, float("nan")])}
    return SharedGroups(**{**fields, **changes})


def test_a_shared_group_round_trips_exactly(tmp_path):
    sent = _shared()
    written = GroupBucket(str(tmp_path), 1, 2).publish(sent)
    got, size = GroupBucket(str(tmp_path), 0, 2).read(1, 3, LIMITS)
    assert size == written
    for name in FIELDS:
        a, b = getattr(sent, name), getattr(got, name)
        assert a.dtype == b.dtype and torch.equal(torch.nan_to_num(a, nan=-7.0), torch.nan_to_num(b, nan=-7.0)), name
    assert (got.learner, got.step, got.version) == (1, 3, 2)
    assert GroupBucket(str(tmp_path), 0, 2).arrived(3) == [1]
    # about 8 bytes a token: 4 completions of up to 5 tokens, and the header
    assert written < 4 * 5 * 8 + 4 * 12 + 2 * 8 + 1024


def test_an_empty_step_round_trips(tmp_path):
    empty = _shared(row_ids=torch.zeros(0, dtype=torch.int64), completion_ids=torch.zeros(0, 0, dtype=torch.int32),
                    lengths=torch.zeros(0, dtype=torch.int32), behaviour_logp=torch.zeros(0, 0),
                    rewards=torch.zeros(0))
    GroupBucket(str(tmp_path), 1, 2).publish(empty)
    got, _ = GroupBucket(str(tmp_path), 0, 2).read(1, 3, LIMITS)
    assert got.num_groups == 0


def _write_raw(tmp_path, tensors: dict, record: dict, learner: int = 1, step: int = 3) -> None:
    """A version written as a hostile learner would: any tensors, any record, a valid manifest."""
    AdapterBucket(f"{tmp_path}/rollouts/learner-{learner:04d}").publish_files(
        step, {"adapter_model.safetensors": save(tensors), "adapter_config.json": json.dumps(record).encode()})


def _fields(s: SharedGroups) -> dict:
    return {name: getattr(s, name) for name in FIELDS}


RECORD = {"step": 3, "learner": 1, "version": 2, "group_size": 2}


@pytest.mark.parametrize("case, tensors, record, message", [
    ("a row outside the rows", {"row_ids": torch.tensor([1, 10])}, {}, "row id outside"),
    ("a repeated row", {"row_ids": torch.tensor([7, 7])}, {}, "repeated"),
    ("a token outside the vocabulary", {"completion_ids": torch.full((4, 5), 100, dtype=torch.int32)}, {},
     "vocabulary"),
    ("a negative token id", {"completion_ids": torch.full((4, 5), -1, dtype=torch.int32)}, {}, "vocabulary"),
    ("a positive log-prob", {"behaviour_logp": torch.full((4, 5), 0.5)}, {}, "above 0"),
    ("a NaN log-prob", {"behaviour_logp": torch.full((4, 5), float("nan"))}, {}, "not finite"),
    ("an infinite log-prob", {"behaviour_logp": torch.full((4, 5), -float("inf"))}, {}, "not finite"),
    ("too long", {"completion_ids": torch.ones(4, 6, dtype=torch.int32), "behaviour_logp": -torch.ones(4, 6)}, {},
     "shapes"),
    ("another group size", {}, {"group_size": 4}, "group size"),
    ("another step", {}, {"step": 2}, "record"),
    ("another learner", {}, {"learner": 0}, "record"),
    ("a version from the future", {}, {"version": 4}, "record"),
    ("a negative round", {}, {"round": -1}, "round"),
    ("a round that is not an integer", {}, {"round": 2.5}, "round"),
    ("a round past 2^31", {}, {"round": 1 << 40}, "round"),
    ("a float token id", {"completion_ids": torch.ones(4, 5)}, {}, "completion_ids is torch.float32"),
    ("a length beyond the width", {"lengths": torch.tensor([3, 1, 6, 2], dtype=torch.int32)}, {}, "length"),
    ("an empty completion", {"lengths": torch.tensor([3, 0, 5, 2], dtype=torch.int32)}, {}, "length"),
    ("another tensor", {"pickle": torch.zeros(1)}, {}, "tensors"),
    ("more groups than a step has", {"row_ids": torch.arange(5), "completion_ids": torch.ones(10, 5,
     dtype=torch.int32), "lengths": torch.ones(10, dtype=torch.int32), "behaviour_logp": -torch.ones(10, 5),
     "rewards": torch.zeros(10)}, {}, "shapes"),
])
def test_hostile_groups_are_refused(tmp_path, case, tensors, record, message):
    _write_raw(tmp_path, {**_fields(_shared()), **tensors}, {**RECORD, **record})
    with pytest.raises(RefusedGroups, match=message):
        GroupBucket(str(tmp_path), 0, 2).read(1, 3, LIMITS)


def test_oversize_files_links_and_fifos_are_refused_unread(tmp_path):
    version = tmp_path / "rollouts" / "learner-0001" / "v00000003"
    huge = {**_fields(_shared()), "completion_ids": torch.ones(4, 5, dtype=torch.int32)}
    AdapterBucket(f"{tmp_path}/rollouts/learner-0001").publish_files(3, {
        "adapter_model.safetensors": save(huge) + b" " * (LIMITS.max_bytes() + 1),
        "adapter_config.json": json.dumps(RECORD).encode()})
    with pytest.raises(RefusedGroups, match="declares"):  # refused from its manifest, before a byte is read
        GroupBucket(str(tmp_path), 0, 2).read(1, 3, LIMITS)
    GroupBucket(str(tmp_path), 1, 2).publish(_shared())
    payload = version / "adapter_model.safetensors"
    payload.unlink()
    os.mkfifo(payload)  # a FIFO would block a reader forever
    with pytest.raises(RefusedGroups, match="not a regular file"):
        GroupBucket(str(tmp_path), 0, 2).read(1, 3, LIMITS)
    payload.unlink()
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(save(_fields(_shared())))
    payload.symlink_to(secret)  # a link out of the bucket is never followed
    with pytest.raises(RefusedGroups, match="outside the bucket"):
        GroupBucket(str(tmp_path), 0, 2).read(1, 3, LIMITS)


# ------------------------------------------------------------------------------------------- real learners
def _overrides(out: Path, model_dir: Path, *extra: str) -> list[str]:
    return [f"output_dir={out}", f"model.name={model_dir}", "model.lora=true", "model.lora_r=4", "task.eval_size=4",
            "rollout.group_size=4", "rollout.max_new_tokens=6", "train.micro_batch_size=8", "train.steps=4",
            "train.checkpoint_every=0", "train.threads=1", "algo.beta=0", "train.lr=1e-3", "eval.every=0",
            "log.progress=false", "log.trackers=[]", "log.plot=false", "algo.dynamic_sampling=true",
            "algo.max_resample_rounds=0", "rollout.per_completion_seeds=true",
            "rewards=[{name: 'tests.helpers:length_reward'}]", *extra]


def _learner(out: Path, model_dir: Path, bucket: Path, k: int, *extra: str) -> list[str]:
    return _overrides(out, model_dir, "train.prompts_per_step=2", f"diloco.learner={k}/2", f"diloco.bucket={bucket}",
                      *extra)


def _train_here(overrides: list[str]) -> dict:
    from rlvr.config.loading import load_config
    from rlvr.launch import train

    threads = torch.get_num_threads()
    try:
        return train(load_config(ROOT / "examples" / "demo.yaml", overrides))
    finally:
        torch.set_num_threads(threads)


def _pair(tmp_path: Path, model_dir: Path, *extra: str) -> tuple[Path, Path]:
    """Learner 1 forked, learner 0 here; both to the end."""
    bucket, log = tmp_path / "bucket", tmp_path / "l1.log"
    other = start_forked_train(_learner(tmp_path / "l1", model_dir, bucket, 1, *extra), "", log)
    try:
        _train_here(_learner(tmp_path / "l0", model_dir, bucket, 0, *extra))
    except BaseException:
        other.kill()
        other.join()
        raise
    assert join_forked(other) == 0, _tail(log)
    return tmp_path / "l0", tmp_path / "l1"


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_learners_sharing_each_step_are_one_learner_at_twice_the_batch(tiny_model_dir, tmp_path):
    l0, l1 = _pair(tmp_path, tiny_model_dir, "diloco.rollouts=step", "diloco.inner_steps=0")
    _train_here(_overrides(tmp_path / "one", tiny_model_dir, "train.prompts_per_step=4"))
    a, b, one = _adapter(l0), _adapter(l1), _adapter(tmp_path / "one")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same batch from the same weights, every step
    moved = max(float((one[k] - a[k]).abs().max()) for k in a)
    trained = max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k)  # lora_B starts at 0
    assert moved < 1e-6 and trained > 1e-3, (moved, trained)  # one learner at 4 prompts, up to rounding (3e-8 here)
    for run in (l0, l1):
        rows = [r for r in _metrics(run) if "shared/external_groups" in r]
        assert len(rows) == 4 and sum(r["shared/external_groups"] for r in rows) > 0
        last = rows[-1]
        assert last["shared/total_refused"] == 0 and last["shared/total_reward_mismatch"] == 0
        assert last["shared/total_missed"] == 0 and last["shared/total_bytes_sent"] > 0


# ------------------------------------------------------------------------ a peer's groups, as a learner sees them
PROMPTS = [[{"role": "user", "content": "3 + 4 ="}], [{"role": "user", "content": "12 * 9 ="}]]


def _peer_groups(tokenizer, forged_logp: float | None = None):
    """Two groups a peer sampled from its own (other) policy, with forged rewards; and the receiver's model."""
    from rlvr.rollout import SamplingParams
    from tests.conftest import make_model, sample_tiny

    behaviour = make_model(len(tokenizer), seed=0)
    groups = sample_tiny(behaviour, tokenizer, PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=8), seed=5,
                         eos_every=7, version=2)
    mask = groups.completion_mask.bool()
    logp = groups.behaviour_logp if forged_logp is None else torch.full_like(groups.behaviour_logp, forged_logp)
    shared = SharedGroups(learner=1, step=3, version=2, group_size=4, row_ids=torch.tensor([0, 1]),
                          completion_ids=groups.completion_ids.int().masked_fill(~mask, 0),
                          lengths=mask.sum(dim=1).int(), behaviour_logp=logp.float().masked_fill(~mask, 0.0),
                          rewards=torch.full((8,), 100.0))  # "every completion is perfect"
    trainer = make_model(len(tokenizer), seed=0).double()
    with torch.no_grad():  # the receiver has moved on from the peer's policy
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.15)
    return shared, trainer, groups


def _receiver(tokenizer):
    from rlvr.rewards import WeightedReward
    from rlvr.run.shared_rollouts import Receiver
    from tests.helpers import length_reward

    rows = [{"prompt": p} for p in PROMPTS]
    return Receiver(rows, tokenizer, [WeightedReward("length", length_reward)],
                    GroupLimits(max_groups=2, group_size=4, max_tokens=8, vocab=len(tokenizer), rows=2),
                    list(range(0, len(tokenizer), 7)), (), 1.0)  # sample_tiny's EOS ids (eos_every=7)


def _update(trainer, round_, lr=0.3):
    """One sequence-mean step (SGD) on the rebuilt groups, with the run's advantages; the trained copy and stats."""
    import copy

    from rlvr.core import LossSettings
    from rlvr.learn.batch import StepBatch
    from rlvr.learn.learner import Learner
    from rlvr.learn.step import StepOptions, train_step
    from rlvr.run.collect import group_advantage_fn

    adv = group_advantage_fn(4, "group", 1e-4, 1.0)(round_.scores).double()
    batch = StepBatch.from_groups(round_.groups, adv)
    model = copy.deepcopy(trainer)
    stats = train_step(Learner(model, torch.optim.SGD(model.parameters(), lr=lr)), batch, LossSettings(),
                       StepOptions(micro_batch_size=8, max_completion_tokens=8, max_grad_norm=0.0))
    return model, batch, stats


def test_external_groups_are_rescored_and_weighted_by_the_formula(tokenizer):
    """The peer's rewards are never used: each completion is scored by the receiver's own reward (its text's length),
    and the update weighs each token by w = min(pi_theta / mu, 2), mu the peer's log-probs - written out here."""
    from tests.test_off_policy import _assert_same_weights, _expected_update

    shared, trainer, sampled = _peer_groups(tokenizer)
    round_, informative, mismatched = _receiver(tokenizer).rebuilt(shared)
    texts = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(shared.completion_ids.long(), shared.mask)],
                                   skip_special_tokens=True)
    assert round_.scores.total.tolist() == [float(len(t)) for t in texts]  # its own reward, not the claimed 100
    assert mismatched == 8 and informative.tolist() == [len(set(map(len, texts[:4]))) > 1,
                                                        len(set(map(len, texts[4:]))) > 1]
    for g in range(2):  # rebuilt from its own copy of the row: the prompt the peer sampled from
        got, peer = round_.groups, sampled
        assert got.prompt_ids[g][got.prompt_mask[g].bool()].tolist() == \
            peer.prompt_ids[g][peer.prompt_mask[g].bool()].tolist()
    assert torch.equal(round_.groups.completion_mask, sampled.completion_mask)
    assert torch.equal(round_.groups.truncated, sampled.truncated)  # found again from the tokens
    model, batch, stats = _update(trainer, round_)

    def tis(logp, mu, adv):  # [N, T]: w = min(pi_theta / mu, 2); the ratio to pi_prox = pi_theta: value 1
        return -torch.exp(logp.detach() - mu).clamp(max=2.0) * adv * torch.exp(logp - logp.detach())

    _assert_same_weights(model, _expected_update(trainer, batch, tis, lr=0.3))
    assert stats["is_capped_frac"] > 0 and stats["is_weight_max"] > 2.0  # the two policies really differ


def test_forged_log_probs_move_a_learner_no_more_than_the_cap(tokenizer):
    """A peer that claims its tokens were nearly impossible under its policy (log-prob -50, so pi_theta / mu ~ e^50)
    weighs them at the cap, 2: the update of a group whose every weight is exactly 2, and no more."""
    from tests.test_off_policy import _assert_same_weights, _expected_update

    shared, trainer, _ = _peer_groups(tokenizer, forged_logp=-50.0)
    round_, _, _ = _receiver(tokenizer).rebuilt(shared)
    model, batch, stats = _update(trainer, round_)
    assert stats["is_capped_frac"] == pytest.approx(1.0)

    def at_the_cap(logp, mu, adv):  # every weight exactly 2
        return -2.0 * adv * torch.exp(logp - logp.detach())

    _assert_same_weights(model, _expected_update(trainer, batch, at_the_cap, lr=0.3))


# --------------------------------------------------------------------------------- hostile and absent peers
def _hostile_version(bucket: Path, step: int, rows: list[int], vocab: int, **tensors) -> None:
    """Learner 1's groups of ``step`` as a hostile learner writes them: random tokens, every reward claimed 100."""
    g = torch.Generator().manual_seed(step)
    n = len(rows) * 4
    lengths = torch.randint(1, 7, (n,), generator=g, dtype=torch.int32)
    fields = {"row_ids": torch.tensor(rows), "completion_ids": torch.randint(3, vocab, (n, 6), generator=g,
                                                                              dtype=torch.int32),
              "lengths": lengths, "behaviour_logp": -torch.rand(n, 6, generator=g) - 0.1,
              "rewards": torch.full((n,), 100.0), **tensors}
    _write_raw(bucket, fields, {"step": step, "learner": 1, "version": step - 1, "group_size": 4}, step=step)


def test_a_hostile_learner_is_refused_rescored_and_never_waited_on(tiny_model_dir, tokenizer, tmp_path):
    """rollouts=recent: learner 1's step 1 claims reward 100 for every completion (re-scored: 8 mismatches, trained
    at their real worth), its step 2 sends a prompt of learner 0's shard and its step 3 a token outside the
    vocabulary (both refused). Learner 0 never waits for it and trains every step."""
    bucket, V = tmp_path / "bucket", len(tokenizer)
    _hostile_version(bucket, 1, [1, 3], V)
    _hostile_version(bucket, 2, [1, 2], V)  # row 2 is learner 0's (2 mod 2 = 0)
    _hostile_version(bucket, 3, [5], V, completion_ids=torch.full((4, 6), V, dtype=torch.int32))
    _train_here(_learner(tmp_path / "l0", tiny_model_dir, bucket, 0, "diloco.rollouts=recent",
                         "diloco.inner_steps=0", "diloco.rollout_max_age=3"))
    rows = [r for r in _metrics(tmp_path / "l0") if "shared/external_groups" in r]
    last = rows[-1]
    assert len(rows) == 4 and last["shared/total_refused"] == 2 and last["shared/total_reward_mismatch"] == 8
    assert last["shared/total_external_groups"] + last["shared/total_rescored_flat"] == 2  # step 1's two groups
    assert rows[0]["shared/external_groups"] == last["shared/total_external_groups"]  # trained at step 1 only
    assert all(r["shared/wait_s"] < 5 for r in rows)


def test_a_step_goes_on_without_an_absent_learner_and_waits_for_it_no_more(tiny_model_dir, tmp_path):
    bucket = tmp_path / "bucket"
    _train_here(_learner(tmp_path / "l0", tiny_model_dir, bucket, 0, "diloco.rollouts=step", "diloco.inner_steps=0",
                         "diloco.rollout_timeout_s=1", "eval.on_start=false"))
    assert min(r["step"] for r in _metrics(tmp_path / "l0")) == 1  # eval.on_start=false: no evaluation at step 0
    rows = [r for r in _metrics(tmp_path / "l0") if "shared/external_groups" in r]
    assert [r["shared/total_missed"] for r in rows] == [1, 1, 1, 1]  # waited for once, at step 1
    assert rows[0]["shared/wait_s"] >= 1 and all(r["shared/wait_s"] < 1 for r in rows[1:])
    assert sum(r["shared/published_groups"] for r in rows) > 0 and rows[-1]["shared/total_external_groups"] == 0
    from rlvr.store.rounds import RefusedDelta

    with pytest.raises(RefusedDelta, match="rollouts"):  # other questions under the same row ids: refused at join
        _train_here(_learner(tmp_path / "l1", tiny_model_dir, bucket, 1, "diloco.rollouts=step", "diloco.inner_steps=0",
                             "task.seed=7", "diloco.join=true"))


def test_learners_sharing_recent_groups_train_on_each_others(tiny_model_dir, tmp_path):
    l0, l1 = _pair(tmp_path, tiny_model_dir, "diloco.rollouts=recent", "diloco.inner_steps=2",
                   "diloco.outer_lr=1.0", "diloco.outer_momentum=0")
    for run in (l0, l1):
        last = [r for r in _metrics(run) if "shared/external_groups" in r][-1]
        assert last["shared/total_refused"] == 0 and last["shared/total_reward_mismatch"] == 0
        assert last["shared/total_bytes_received"] > 0 and last["update/outer_rounds"] == 2
    a, b = _adapter(l0), _adapter(l1)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the last round's shared weights
