"""Clipping, KL estimators and aggregation against values worked out by hand."""

import math

import pytest
import torch

from rlvr.core import LossSettings, TokenBatch, aggregate, kl_penalty, loss_normaliser, policy_loss
from rlvr.core import clipped_surrogate as surrogate_of_ratio


def clipped_surrogate(logp, old, adv, eps_low, eps_high, dual_clip=0.0):
    """The clipped surrogate of the ratio exp(logp - old)."""
    return surrogate_of_ratio(torch.exp(logp - old), adv, LossSettings(eps_low=eps_low, eps_high=eps_high,
                                                                       dual_clip=dual_clip))


def _ratios(*r):
    """logp / old_logp pairs whose ratio exp(logp - old) is r."""
    old = torch.zeros(len(r)).unsqueeze(0)
    return torch.log(torch.tensor(r)).unsqueeze(0), old


def test_clip_high_caps_positive_advantage():
    logp, old = _ratios(1.5, 1.1, 0.5)
    loss, flags = clipped_surrogate(logp, old, torch.tensor([1.0]), eps_low=0.2, eps_high=0.2)
    # A = 1: ratio 1.5 -> max(-1.5, -1.2) = -1.2 (clipped); 1.1 -> -1.1; 0.5 -> max(-0.5, -0.8) = -0.5
    assert torch.allclose(loss, torch.tensor([[-1.2, -1.1, -0.5]]))
    assert flags["clip_high"].tolist() == [[True, False, False]]
    assert not flags["clip_low"].any()


def test_clip_low_caps_negative_advantage():
    logp, old = _ratios(0.5, 1.5)
    loss, flags = clipped_surrogate(logp, old, torch.tensor([-1.0]), eps_low=0.2, eps_high=0.2)
    # A = -1: ratio 0.5 -> max(0.5, 0.8) = 0.8 (clipped); 1.5 -> max(1.5, 1.2) = 1.5 (unclipped)
    assert torch.allclose(loss, torch.tensor([[0.8, 1.5]]))
    assert flags["clip_low"].tolist() == [[True, False]]


def test_asymmetric_clip_higher():
    logp, old = _ratios(1.25, 1.3)
    loss, flags = clipped_surrogate(logp, old, torch.tensor([2.0]), eps_low=0.2, eps_high=0.28)
    # A = 2: 1.25 is inside 1.28 -> -2.5; 1.3 clipped to 1.28 -> -2.56
    assert torch.allclose(loss, torch.tensor([[-2.5, -2.56]]))
    assert flags["clip_high"].tolist() == [[False, True]]


def test_dual_clip_bounds_negative_advantage_loss():
    logp, old = _ratios(5.0, 2.0)
    loss, flags = clipped_surrogate(logp, old, torch.tensor([-1.0]), 0.2, 0.2, dual_clip=3.0)
    # A = -1: ratio 5 -> max(5, 1.2) = 5, capped at 3 * |A| = 3; ratio 2 -> 2 (below the cap)
    assert torch.allclose(loss, torch.tensor([[3.0, 2.0]]))
    assert flags["clip_dual"].tolist() == [[True, False]]
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        clipped_surrogate(logp, old, torch.tensor([-1.0]), 0.2, 0.2, dual_clip=0.5)
    assert "clip_dual" not in clipped_surrogate(logp, old, torch.tensor([-1.0]), 0.2, 0.2, dual_clip=0.0)[1]
    with pytest.raises(ValueError, match=r"dual_clip must be > 1 \(or 0 to disable\); got 0.5"):
        LossSettings(dual_clip=0.5)


def test_surrogate_gradient_is_zero_when_clipped():
    logp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_()
    loss, _ = clipped_surrogate(logp, torch.zeros(1, 2), torch.tensor([1.0]), 0.2, 0.2)
    loss.sum().backward()
    # d(-A * ratio)/d logp = -A * ratio: 0 where clipped, -1 at ratio 1
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -1.0]]))


def test_kl_estimators_by_hand():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    x = math.log(0.5)  # ref - logp
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-x)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * x * x)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 - x)
    for est in ("k1", "k2", "k3"):
        assert kl_penalty(logp, logp, est).item() == 0.0
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("sequence_mean", (6 / 3 + 4 / 1) / 2),  # mean per sequence, then over 2 sequences
        ("token_mean", 10 / 4),  # 4 real tokens
        ("token_sum_constant", 10 / (3 * 2)),  # max_new_tokens 3 x 2 sequences
    ],
)
def test_aggregation_by_hand(mode, expected):
    norm = loss_normaliser(MASK, mode, max_new_tokens=3)
    assert aggregate(PER_TOKEN, MASK, mode, norm).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["sequence_mean", "token_mean", "token_sum_constant"])
def test_aggregation_splits_exactly_across_micro_batches(mode):
    torch.manual_seed(0)
    per_token = torch.randn(8, 5)
    mask = (torch.rand(8, 5) > 0.3).long()
    mask[:, 0] = 1
    norm = loss_normaliser(mask, mode, max_new_tokens=5)
    whole = aggregate(per_token, mask, mode, norm)
    parts = sum(aggregate(per_token[i : i + 1], mask[i : i + 1], mode, norm) for i in range(8))
    assert torch.allclose(whole, parts, atol=1e-6)


def test_normaliser_ignores_excluded_rows():
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    assert loss_normaliser(mask, "sequence_mean", 2) == 2
    assert loss_normaliser(mask, "token_mean", 2) == 3
    assert loss_normaliser(mask, "token_sum_constant", 2) == 4
    # TRL's count: every row, the one without a trained token too; the token count is the same either way
    assert loss_normaliser(mask, "sequence_mean", 2, every_row=True) == 3
    assert loss_normaliser(mask, "sequence_sum", 2, every_row=True) == 3
    assert loss_normaliser(mask, "token_mean", 2, every_row=True) == 3
    assert loss_normaliser(mask, "token_sum_constant", 2, every_row=True) == 6


def test_policy_loss_adds_beta_times_kl():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.tensor([[1, 1]])
    settings = LossSettings(beta=0.1, kl_estimator="k3", aggregation="token_mean")
    adv = torch.tensor([[2.0]])
    x = TokenBatch(logp=logp, behaviour_logp=logp, adv=adv, mask=mask.float(), ref_logp=ref)
    loss, stats = policy_loss(x, settings, normaliser=2.0, step_tokens=2.0)
    k3 = 0.5 - 1 - math.log(0.5)
    # ratio 1 everywhere: surrogate -2 per token; KL k3 on token 1, 0 on token 2
    assert loss.item() == pytest.approx((-2 + 0.1 * k3 - 2 + 0.0) / 2)
    assert stats["kl"] == pytest.approx(k3)
    assert stats["tokens"] == 2
    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_loss(TokenBatch(logp=logp, behaviour_logp=logp, adv=adv, mask=mask.float()), settings, 2.0, 2.0)


def test_ratio_weighted_kl_adds_kl_times_the_score_on_policy():
    """kl_ratio_weighted (TRL's use_bias_correction_kl): per token beta * k3 * pi/pi_prox. On-policy the ratio is 1,
    so the loss is unchanged, and its gradient adds beta * k3 * d logp to the plain estimator's beta * (1 - e^x),
    x = ref - logp: d/dlogp [k3 * exp(logp - logp.detach())] = (1 - e^x) + k3."""
    from rlvr.core import token_loss

    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    zeros = torch.zeros(1, 2, dtype=torch.float64)
    ones = torch.ones(1, 2, dtype=torch.float64)

    def loss_and_grad(weighted: bool):
        x = TokenBatch(logp=logp, behaviour_logp=logp.detach(), adv=zeros, mask=ones, ref_logp=ref)
        loss, _ = token_loss(x, LossSettings(beta=0.5, kl_ratio_weighted=weighted, is_level="none"))
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        return loss.detach(), grad

    plain_loss, plain_grad = loss_and_grad(False)
    loss, grad = loss_and_grad(True)
    x = ref - logp.detach()
    k3 = torch.expm1(x) - x
    assert torch.allclose(loss, plain_loss) and torch.allclose(loss, 0.5 * k3)
    assert torch.allclose(plain_grad, 0.5 * (1 - torch.exp(x)))
    assert torch.allclose(grad, 0.5 * (1 - torch.exp(x) + k3))


def test_ratio_weighted_kl_uses_the_sequence_ratio_under_gspo():
    """Under gspo the weight is exp(mean_t log(pi/pi_prox)) per completion, the same for its every token."""
    from rlvr.core.losses import kl_ratio


    logp = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64)
    prox = torch.tensor([[-1.2, -1.6, -5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    x = TokenBatch(logp=logp, behaviour_logp=prox, adv=torch.zeros_like(logp), mask=mask)
    expected = torch.exp(torch.tensor((0.2 - 0.4) / 2, dtype=torch.float64))  # the masked token does not count
    assert torch.allclose(kl_ratio(x, prox, sequence=True), expected.expand(1, 1))
    assert torch.allclose(kl_ratio(x, prox, sequence=False), torch.exp(logp - prox))
