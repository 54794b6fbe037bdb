"""collect(): sampling rounds, DAPO's dynamic sampling (DynamicSampling) and its bookkeeping, against hand-built reward
tables."""

import pytest
import torch

from rlvr.platform.seeds import round_seed
from rlvr.rewards import WeightedReward
from rlvr.rollout import Groups, SamplingParams
from rlvr.run.collect import collect, collect_metrics, group_advantage_fn
from rlvr.run.dynamic_sampling import DynamicSampling

G = 4
INFORMATIVE, ALL_RIGHT, ALL_WRONG = [1.0, 0.0, 0.0, 0.0], [1.0] * G, [0.0] * G


class ScriptedSampler:
    """Completion j of prompt p is the text 'p#j'; records the seeds it was asked for."""

    version = 7

    def __init__(self):
        self.seeds = []

    def sample(self, prompts, group_size, params, seed):
        self.seeds.append(seed)
        b, n = len(prompts), len(prompts) * group_size
        return Groups(
            prompt_ids=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
            completion_ids=torch.ones(n, 2, dtype=torch.long), completion_mask=torch.ones(n, 2, dtype=torch.long),
            behaviour_logp=torch.full((n, 2), -1.0), truncated=torch.zeros(n, dtype=torch.bool),
            texts=[f"{p}#{j}" for p in prompts for j in range(group_size)], group_size=group_size,
            version=torch.full((n,), self.version), temperature=torch.ones(n),
        )

    def sync(self, version):
        self.version = version


def table_reward(prompts, completions, pattern, **columns):
    """The row's reward pattern, indexed by the completion's number within its group."""
    return [p[int(c.split("#")[1])] for c, p in zip(completions, pattern)]


def _run(patterns, B=3, dynamic=True, extra=3):
    rows = [{"prompt": f"p{i}", "pattern": pat} for i, pat in enumerate(patterns)]
    cursor = {"at": 0}

    def next_row_ids():
        ids = list(range(cursor["at"], cursor["at"] + B))
        cursor["at"] += B
        return ids

    sampler = ScriptedSampler()
    rewards = [WeightedReward("table", table_reward)]
    c = collect(sampler, next_row_ids, rows, G, SamplingParams(), rewards,
                group_advantage_fn(G, "group", 1e-4, 1.0), seed=11, dynamic_sampling=dynamic,
                max_resample_rounds=extra)
    return c, sampler, cursor["at"]


def test_without_dynamic_sampling_one_round_is_trained_as_is():
    c, sampler, consumed = _run([INFORMATIVE, ALL_RIGHT, ALL_WRONG] + [INFORMATIVE] * 3, dynamic=False)
    assert c.row_ids == [0, 1, 2] and consumed == 3 and sampler.seeds == [11]
    assert c.adv.view(3, G)[1:].eq(0).all() and c.adv.view(3, G)[0].ne(0).all()
    m = collect_metrics(c, version=7)
    assert m["zero_variance_frac"] == pytest.approx(2 / 3) and m["groups_trained"] == 3 and m["sampling_rounds"] == 1


def test_dynamic_sampling_resamples_until_b_informative_groups():
    # round 0: 1 informative of 3; round 1: 2 of 3 -> 3 informative, stop
    patterns = [INFORMATIVE, ALL_RIGHT, ALL_WRONG, ALL_WRONG, INFORMATIVE, INFORMATIVE, INFORMATIVE]
    c, sampler, consumed = _run(patterns)
    assert c.row_ids == [0, 4, 5] and consumed == 6
    assert sampler.seeds == [11, round_seed(11, 1)] == [11, 11 + 1_000_000_007]
    assert c.groups.texts[:G] == [f"p0#{j}" for j in range(G)]
    assert c.groups.texts[G : 2 * G] == [f"p4#{j}" for j in range(G)]
    assert c.scores.total.tolist() == INFORMATIVE * 3
    # group-std advantages of [1, 0, 0, 0]: mean 0.25, std (ddof 1) 0.5 -> [1.5, -0.5, -0.5, -0.5]
    assert torch.allclose(c.adv, torch.tensor([1.5, -0.5, -0.5, -0.5] * 3), atol=1e-3)
    m = collect_metrics(c, version=7)
    assert (m["groups_sampled"], m["groups_trained"], m["sampling_rounds"]) == (6, 3, 2)
    assert m["zero_variance_frac"] == pytest.approx(3 / 6)
    assert m["reward_mean"] == pytest.approx((1 + 4 + 0 + 0 + 1 + 1) / 24)  # over everything sampled
    assert m["staleness_max"] == 0


def test_extra_informative_groups_beyond_b_are_dropped():
    c, _, consumed = _run([INFORMATIVE, ALL_RIGHT, ALL_RIGHT] + [INFORMATIVE] * 3)
    assert c.row_ids == [0, 3, 4] and consumed == 6


def test_rounds_run_out_then_the_informative_groups_are_trained():
    c, sampler, consumed = _run([ALL_RIGHT, INFORMATIVE, ALL_RIGHT, ALL_WRONG, ALL_WRONG, ALL_WRONG], extra=1)
    assert c.row_ids == [1] and consumed == 6 and len(sampler.seeds) == 2
    assert collect_metrics(c, version=7)["groups_trained"] == 1


def test_no_informative_group_trains_the_first_round_with_zero_advantages():
    c, _, _ = _run([ALL_RIGHT] * 3 + [ALL_WRONG] * 3, extra=1)
    assert c.row_ids == [0, 1, 2] and c.adv.eq(0).all()


def test_staleness_is_measured_against_the_learner_version():
    c, _, _ = _run([INFORMATIVE] * 3)
    m = collect_metrics(c, version=9)  # sampled at version 7
    assert m["staleness_mean"] == 2 and m["staleness_max"] == 2


def test_a_batch_without_any_reward_is_said_once(capsys):
    from rlvr.run.collect import warn_unscored

    rows = [{"prompt": f"p{i}"} for i in range(3)]
    sampler = ScriptedSampler()
    rewards = [WeightedReward("never", lambda prompts, completions, **_: [None] * len(completions))]
    c = collect(sampler, lambda: [0, 1, 2], rows, G, SamplingParams(), rewards, None, seed=1)
    assert torch.isnan(c.scores.total).all() and c.adv is None
    assert warn_unscored(c, 3, warned=False) and warn_unscored(c, 4, warned=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlvr: warning: step 3: no completion") and "'never'" in err[0]


def _offer(pick, informative):
    """Offer groups 0, 1, ... with these informative flags until the pick is done; the flags of those kept."""
    kept = []
    for i, flag in enumerate(informative):
        if pick.done:
            break
        kept.append(pick.offer(i, flag))
    return kept


def test_dynamic_sampling_decides_group_by_group():
    off = DynamicSampling(3, enabled=False, max_resample_rounds=3)
    assert _offer(off, [False, True, False, True]) == [True, True, True] and off.trained() == [0, 1, 2]
    on = DynamicSampling(3, enabled=True, max_resample_rounds=3)  # budget 12 groups
    assert _offer(on, [False, True, False, True, True, True]) == [False, True, False, True, True]
    assert on.trained() == [1, 3, 4] and on.sampled == 5
    spent = DynamicSampling(2, enabled=True, max_resample_rounds=1)  # budget 4 groups
    assert _offer(spent, [False, True, False, False, True]) == [False, True, False, False]
    assert spent.done and spent.trained() == [1]
    flat = DynamicSampling(2, enabled=True, max_resample_rounds=1)
    _offer(flat, [False] * 6)
    assert flat.sampled == 4 and flat.trained() == [0, 1]  # none informative: the first B, as they are


def test_informative_groups_offered_after_b_are_not_kept():
    """A synchronous round is offered whole: informative groups past the B-th are dropped (DAPO)."""
    pick = DynamicSampling(3, enabled=True, max_resample_rounds=3)
    assert [pick.offer(i, flag) for i, flag in enumerate([True, False, False, True, True, True])] == [
        True, False, False, True, True, False]
    assert pick.done and pick.trained() == [0, 3, 4]


def test_normalize_then_sum_weighs_each_reward_within_its_group():
    """GDPO through collect(): a 0/1 reward and a large-scale one; by the weighted sum the large one decides the
    order within a group, normalised first each counts by its weight (values as tests/core's hand example)."""
    import math

    rows = [{"prompt": "p0", "pattern": [1.0, 0.0, 1.0, 1.0], "size": [10.0, 30.0, 20.0, 40.0]}]

    def size_reward(prompts, completions, size, **columns):
        return [s[int(c.split("#")[1])] for c, s in zip(completions, size)]

    rewards = [WeightedReward("table", table_reward), WeightedReward("size", size_reward, weight=1.0)]
    G2 = 2

    def run(aggregation):
        return collect(ScriptedSampler(), lambda: [0, 0], rows, G2, SamplingParams(), rewards,
                       group_advantage_fn(G2, "group", 0.0, 1.0, aggregation), seed=3).adv

    # two groups of two (the one row twice): rewards (1, 10), (0, 30) | (1, 10), (0, 30)
    summed = run("sum_then_normalize")
    assert summed[0] < 0 < summed[1]  # 11 < 30: the large reward wins within each group
    gdpo = run("normalize_then_sum")
    # per group: correctness +-1/sqrt(2), size -+1/sqrt(2): every sum 0, so no completion is preferred
    assert torch.allclose(gdpo, torch.zeros(4), atol=1e-6) and not math.isnan(float(gdpo.sum()))


def test_rounds_concatenate_into_one_round_of_their_groups():
    """Round.concat (what the asynchronous source makes of the one-group rounds it takes): rows, informative flags,
    versions and uids in order, times summed."""
    from dataclasses import replace

    from rlvr.learn.collected import Round

    c, _, _ = _run([ALL_RIGHT, INFORMATIVE, ALL_WRONG, INFORMATIVE, INFORMATIVE, ALL_RIGHT])  # two rounds
    a, b = c.rounds
    whole = Round.concat([a, b])
    assert whole.row_ids == [0, 1, 2, 3, 4, 5] and whole.uids is None
    assert whole.informative.tolist() == [False, True, False, True, True, False]
    assert whole.versions.tolist() == [7] * 6 and whole.groups.num_groups == 6
    assert whole.time_generate_s == a.time_generate_s + b.time_generate_s
    assert Round.concat([replace(a, uids=[5, 6, 7]), replace(b, uids=[8, 9, 10])]).uids == [5, 6, 7, 8, 9, 10]
