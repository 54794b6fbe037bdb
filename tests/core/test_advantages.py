"""Advantages against values worked out by hand."""

import math

import pytest
import torch

from rlvr.core import group_advantages, zero_variance_fraction


def test_group_scaling_by_hand():
    # mean 0.25, centred [0.75, -0.25, -0.25, -0.25]; unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_group_scaling_with_eps():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, eps=1e-4)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]) / 0.5001)


def test_groups_are_independent():
    # group 1: [2, 0] -> mean 1, std sqrt(2) -> +-1/sqrt(2); group 2: [5, 7] -> -+1/sqrt(2)
    adv = group_advantages(torch.tensor([2.0, 0.0, 5.0, 7.0]), group_size=2, eps=0.0)
    h = 1 / math.sqrt(2)
    assert torch.allclose(adv, torch.tensor([h, -h, -h, h]))


def test_batch_scaling_by_hand():
    # centred by group: [0.5, -0.5, 0, 0]; batch std of [1, 0, 1, 1]: mean .75, var (3 * .0625 + .5625) / 3 = .25
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2, scale="batch", eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_no_scaling_only_centres():
    adv = group_advantages(torch.tensor([3.0, 1.0, 0.0, 4.0]), group_size=2, scale="none")
    assert torch.equal(adv, torch.tensor([1.0, -1.0, -2.0, 2.0]))


def test_negative_scale_damps_only_negative_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0])  # second group: no signal, stays 0
    # first group as in test_group_scaling_by_hand: [1.5, -0.5, -0.5, -0.5]; the negatives x 0.5, then x 0
    adv = group_advantages(r, group_size=4, eps=0.0, negative_scale=0.5)
    assert torch.allclose(adv, torch.tensor([1.5, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    adv = group_advantages(r, group_size=4, scale="none", negative_scale=0.0)
    assert torch.equal(adv, torch.tensor([0.75, 0, 0, 0, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="negative_scale"):
        group_advantages(r, group_size=4, negative_scale=1.5)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_group_is_exactly_zero(scale):
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5])  # 0.1 * 3 / 3 != 0.1 in floating point
    adv = group_advantages(rewards, group_size=3, scale=scale)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.isfinite(adv).all()


def test_singleton_groups_are_zero():
    adv = group_advantages(torch.tensor([1.0, 0.0, 3.0]), group_size=1)
    assert torch.equal(adv, torch.zeros(3))


def test_missing_rewards_are_excluded():
    # valid [1, 0, 0]: mean 1/3, centred [2/3, -1/3, -1/3], unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3
    adv = group_advantages(torch.tensor([1.0, float("nan"), 0.0, 0.0]), group_size=4, eps=0.0)
    s = math.sqrt(1 / 3)
    assert torch.allclose(adv, torch.tensor([(2 / 3) / s, 0.0, (-1 / 3) / s, (-1 / 3) / s]))


def test_group_with_one_valid_reward_is_zero():
    adv = group_advantages(torch.tensor([float("nan"), 1.0, float("nan"), float("nan")]), group_size=4)
    assert torch.equal(adv, torch.zeros(4))


def test_all_missing_is_zero_not_nan():
    adv = group_advantages(torch.full((4,), float("nan")), group_size=2, scale="batch")
    assert torch.equal(adv, torch.zeros(4))


@pytest.mark.parametrize("G", [2, 4, 16])
def test_outlier_bound(G):
    # one outlier: |A| = (G - 1) / sqrt(G) with unbiased std, below sqrt(G)
    rewards = torch.zeros(G)
    rewards[0] = 1000.0
    adv = group_advantages(rewards, group_size=G, eps=0.0)
    assert adv[0].item() == pytest.approx((G - 1) / math.sqrt(G), rel=1e-5)
    assert adv.abs().max() < math.sqrt(G)


def test_zero_variance_fraction():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), 2.0])
    assert zero_variance_fraction(rewards, 2) == pytest.approx(2 / 3)


def test_rejects_bad_shapes_and_scale():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="scale must be one of"):
        group_advantages(torch.zeros(4), group_size=2, scale="std")  # type: ignore[arg-type]


def test_normalize_then_sum_by_hand():
    """GDPO: two groups of two, a 0/1 reward and a length-like reward ten times larger. Per function and group:
    (R - mean) / std (ddof 1): correctness +-1/sqrt(2) in group 0, 0 in group 1 (no spread); length -+1/sqrt(2) in
    both groups. Sums: 0, 0, -1/sqrt(2), +1/sqrt(2); over the batch mean 0, std sqrt(1/3), so the last two are
    -+sqrt(3/2) and the first two 0."""
    from rlvr.core.advantages import normalize_then_sum

    nan = float("nan")

    rewards = torch.tensor([[1.0, 10.0], [0.0, 30.0], [1.0, 20.0], [1.0, 40.0]])
    adv = normalize_then_sum(rewards, torch.tensor([1.0, 1.0]), group_size=2, eps=0.0)
    assert torch.allclose(adv, torch.tensor([0.0, 0.0, -math.sqrt(1.5), math.sqrt(1.5)]), atol=1e-6)
    # a completion no function scored gets 0 and stays out of the batch's mean and std
    rewards = torch.tensor([[1.0, 10.0], [0.0, 30.0], [1.0, 20.0], [1.0, 40.0], [nan, nan], [nan, nan]])
    adv = normalize_then_sum(rewards, torch.tensor([1.0, 1.0]), group_size=2, eps=0.0)
    assert torch.allclose(adv, torch.tensor([0.0, 0.0, -math.sqrt(1.5), math.sqrt(1.5), 0.0, 0.0]), atol=1e-6)
    # weights scale each function's normalised column: correctness x3 makes row 0 the best of its group
    adv = normalize_then_sum(rewards[:4], torch.tensor([3.0, 1.0]), group_size=2, eps=0.0)
    assert adv[0] > adv[1] and adv[2] < adv[3]
