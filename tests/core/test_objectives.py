"""Each objective's per-token loss and gradient against its paper's formula, written out here on tiny tensors.

Two completions, old log-probs 0 so each ratio r is exp(logp): completion 0 has tokens with r = 1.5 and 0.96
(GSPO's sequence ratio sqrt(1.5 * 0.96) = 1.2) and advantage +1; completion 1 has one token with r = 1.05 (the
second column is padding) and advantage -1.
"""

import math

import pytest
import torch

from rlvr.core import LossSettings, TokenBatch, aggregate, loss_normaliser, policy_loss, token_loss

RATIOS = [[1.5, 0.96], [1.05, 1.0]]
MASK = [[1.0, 1.0], [1.0, 0.0]]
ADV = [[1.0], [-1.0]]


def _loss(**knobs):
    """token_loss on the two completions; (loss [2, 2], d loss.sum() / d logp [2, 2], statistics)."""
    logp = torch.log(torch.tensor(RATIOS, dtype=torch.float64)).requires_grad_()
    mask = torch.tensor(MASK, dtype=torch.float64)
    x = TokenBatch(logp=logp, behaviour_logp=torch.zeros(2, 2, dtype=torch.float64),
                   adv=torch.tensor(ADV, dtype=torch.float64), mask=mask)
    loss, stats = token_loss(x, LossSettings(ratio_to="behaviour", is_level="none", **knobs))  # r = pi / pi_behav
    (grad,) = torch.autograd.grad((loss * mask).sum(), logp)
    return loss.detach() * mask, grad, stats


def _close(a, b):
    assert torch.allclose(a, torch.tensor(b, dtype=torch.float64), atol=1e-9, rtol=0), (a, b)


def test_ppo_clip_by_hand():
    loss, grad, stats = _loss(objective="ppo_clip", eps_low=0.2, eps_high=0.2)
    # A = 1: r 1.5 -> -min(1.5, 1.2) = -1.2, clipped (no gradient); 0.96 -> -0.96, gradient -A r = -0.96
    # A = -1: r 1.05 -> -min(-1.05, -1.05) = 1.05, gradient -A r = 1.05
    _close(loss, [[-1.2, -0.96], [1.05, 0.0]])
    _close(grad, [[0.0, -0.96], [1.05, 0.0]])
    assert stats["clip_high"].tolist() == [[True, False], [False, False]]


def test_gspo_sequence_ratio_by_hand():
    loss, grad, stats = _loss(objective="gspo", eps_low=0.2, eps_high=0.3)
    # s_0 = exp((log 1.5 + log 0.96) / 2) = 1.2, inside 1.3: every token of completion 0 carries -A s_0 = -1.2;
    # d s_0 / d logp_t = s_0 / |o_0| = 0.6, and each of the two tokens' losses depends on both log-probs:
    # d (sum of the two token losses) / d logp_t = 2 * (-A) * 0.6 = -1.2. s_1 = 1.05, |o_1| = 1: loss 1.05, grad 1.05
    _close(loss, [[-1.2, -1.2], [1.05, 0.0]])
    _close(grad, [[-1.2, -1.2], [1.05, 0.0]])
    assert not stats["clip_high"].any()
    clipped, grad, stats = _loss(objective="gspo", eps_low=0.2, eps_high=0.1)
    # s_0 = 1.2 > 1.1: the whole completion is clipped (loss -1.1, no gradient), token by token
    _close(clipped, [[-1.1, -1.1], [1.05, 0.0]])
    _close(grad, [[0.0, 0.0], [1.05, 0.0]])
    assert stats["clip_high"].tolist() == [[True, True], [False, False]]


def test_gspo_token_has_gspo_values_and_per_token_gradients():
    loss, grad, _ = _loss(objective="gspo_token", eps_low=0.2, eps_high=0.3)
    # s_it = sg[s_i] * pi(t) / sg[pi(t)]: value s_i = 1.2; d s_it / d logp_t = s_i, only through its own token
    _close(loss, [[-1.2, -1.2], [1.05, 0.0]])
    _close(grad, [[-1.2, -1.2], [1.05, 0.0]])
    # with sequence_mean each token is weighted 1/|o_i|: the same gradient as GSPO's sequence loss
    per_seq = aggregate(loss, torch.tensor(MASK, dtype=torch.float64), "sequence_mean", 2.0)
    assert per_seq.item() == pytest.approx((-1.2 + 1.05) / 2)


def test_cispo_by_hand():
    loss, grad, stats = _loss(objective="cispo", eps_low=1.0, eps_high=0.2)
    # weight sg[clip(r, 0, 1.2)] = 1.2, 0.96 | 1.05; loss -w A log pi; gradient -w A (never 0 for a clipped token)
    _close(loss, [[-1.2 * math.log(1.5), -0.96 * math.log(0.96)], [1.05 * math.log(1.05), 0.0]])
    _close(grad, [[-1.2, -0.96], [1.05, 0.0]])
    assert stats["clip_high"].tolist() == [[True, False], [False, False]]


def test_sapo_soft_gate_by_hand():
    loss, grad, stats = _loss(objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)

    def sig(z):
        return 1 / (1 + math.exp(-z))

    # A = 1, tau = 1: -(4 / 1) sigmoid(r - 1); d/dlogp = -4 sigmoid (1 - sigmoid) r
    # A = -1, tau = 1.05: +(4 / 1.05) sigmoid(1.05 (r - 1)); d/dlogp = 4 sigmoid (1 - sigmoid) r
    a, b, c = sig(0.5), sig(-0.04), sig(1.05 * 0.05)
    _close(loss, [[-4 * a, -4 * b], [4 / 1.05 * c, 0.0]])
    _close(grad, [[-4 * a * (1 - a) * 1.5, -4 * b * (1 - b) * 0.96], [4 * c * (1 - c) * 1.05, 0.0]])
    assert not stats["clip_high"].any()
    on_policy = 1 / (1 + math.exp(0))
    assert 4 * on_policy * (1 - on_policy) == 1.0  # at r = 1 the gate's slope is the plain surrogate's


def test_high_entropy_mask_drops_the_policy_term_but_not_the_kl():
    logp = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.25, 0.25]], dtype=torch.float64))
    x = TokenBatch(logp=logp, behaviour_logp=logp, adv=torch.tensor([[2.0]], dtype=torch.float64),
                   mask=torch.ones(1, 2, dtype=torch.float64), ref_logp=ref,
                   high_entropy=torch.tensor([[True, False]]))
    loss, stats = token_loss(x, LossSettings(beta=0.1))
    k3 = 0.5 - 1 - math.log(0.5)
    _close(loss, [[-2.0 + 0.1 * k3, 0.1 * k3]])
    assert stats["entropy_masked_frac"].tolist() == [[False, True]]


def test_entropy_bonus_is_a_mean_over_the_steps_tokens():
    logp = torch.zeros(2, 2, dtype=torch.float64)
    entropy = torch.tensor([[1.0, 2.0], [4.0, 8.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.float64)
    x = TokenBatch(logp=logp, behaviour_logp=logp, adv=torch.zeros(2, 1, dtype=torch.float64), mask=mask,
                   entropy=entropy)
    # policy term 0 (A = 0); bonus -0.5 * (1 + 2 + 4) / 10 trained tokens in the whole step, whatever aggregation
    for aggregation in ("sequence_mean", "token_sum_constant"):
        loss, _ = policy_loss(x, LossSettings(entropy_coef=0.5, aggregation=aggregation), 3.0, step_tokens=10.0)
        assert loss.item() == pytest.approx(-0.5 * 7 / 10)
    (grad,) = torch.autograd.grad(loss, entropy)
    _close(grad, [[-0.05, -0.05], [-0.05, 0.0]])


def test_sequence_sum_aggregation_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # LUSPO: each sequence's sum (6 and 4), averaged over the 2 sequences
    assert aggregate(per_token, mask, "sequence_sum", loss_normaliser(mask, "sequence_sum", 3)).item() == 5.0


@pytest.mark.parametrize("knobs, message", [
    ({"objective": "grpo"}, "objective must be one of ppo_clip, gspo"),
    ({"sapo_tau_neg": 0.0}, "sapo_tau_pos and sapo_tau_neg must be > 0"),
    ({"entropy_coef": -0.1}, "entropy_coef must be >= 0"),
    ({"top_entropy_quantile": 0.0}, r"top_entropy_quantile must be in \(0, 1\]"),
])
def test_bad_settings_name_the_field(knobs, message):
    with pytest.raises(ValueError, match=message):
        LossSettings(**knobs)
