"""GAE, per-token rewards, whitening and the clipped value loss against values worked out by hand."""

import pytest
import torch

from rlvr.core.ppo import PPOSettings, gae, token_rewards, value_loss, whiten


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_by_hand():
    rewards = _t([[0, 0, 1], [0, 2, 0]])
    values = _t([[0.5, 0.6, 0.8], [1.0, 1.0, 9.0]])  # 9: padding, must be ignored
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: delta = [0.1, 0.2, 0.2]; A2 = 0.2, A1 = 0.2 + 0.5 * 0.2 = 0.3, A0 = 0.1 + 0.5 * 0.3 = 0.25
    # row 1: the episode ends after token 1 (V after it is 0): delta1 = 2 - 1 = 1, delta0 = 0 + 1 - 1 = 0
    assert torch.allclose(adv, _t([[0.25, 0.3, 0.2], [0.5, 1.0, 0.0]]))
    assert torch.allclose(returns, _t([[0.75, 0.9, 1.0], [1.5, 2.0, 0.0]]))


def test_gae_discounts():
    adv, _ = gae(_t([[0, 0, 1]]), _t([[0.5, 0.6, 0.8]]), torch.ones(1, 3), gamma=0.9, lam=0.5)
    # delta2 = 0.2; delta1 = 0.9 * 0.8 - 0.6 = 0.12; delta0 = 0.9 * 0.6 - 0.5 = 0.04; gamma * lam = 0.45
    assert torch.allclose(adv, _t([[0.04 + 0.45 * (0.12 + 0.45 * 0.2), 0.12 + 0.45 * 0.2, 0.2]]))


def test_lambda_one_gives_monte_carlo_returns_minus_values():
    values = _t([[0.3, -0.2, 0.7, 0.1]])
    adv, returns = gae(_t([[0, 0, 0, 1.5]]), values, torch.ones(1, 4), gamma=1.0, lam=1.0)
    assert torch.allclose(returns, _t([[1.5] * 4])) and torch.allclose(adv, 1.5 - values)


def test_token_rewards_put_the_reward_last_and_the_kl_everywhere():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    kl = _t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [1, 1, 1]])
    r = token_rewards(_t([1.0, 2.0, 5.0]), mask, kl, kl_coef=0.5)
    assert torch.allclose(r, _t([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0], [0, 0, 0]]))


def test_clipped_value_loss_by_hand():
    loss = value_loss(_t([1.5, 0.9]), _t([1.0, 1.0]), _t([2.0, 0.5]), clip=0.2)
    # first: unclipped (1.5-2)^2 = 0.25, clipped V 1.2 -> 0.64: max -> 0.32; second: 0.9 inside the clip -> 0.08
    assert torch.allclose(loss, _t([0.32, 0.08]))
    assert torch.allclose(value_loss(_t([1.5]), _t([1.0]), _t([2.0]), clip=0.0), _t([0.125]))


def test_whiten_over_real_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w = whiten(_t([[1, 2, 100], [3, 100, 100]]), mask)
    assert w[mask.bool()].tolist() == pytest.approx([-1.0, 0.0, 1.0]) and (w[~mask.bool()] == 0).all()


def test_ppo_settings_checks_name_the_field():
    assert PPOSettings().value_clip == 0.2
    for bad, message in ({"lam": 1.5}, "lam must be in"), ({"value_clip": -0.1}, "value_clip must be >= 0"):
        with pytest.raises(ValueError, match=message):
            PPOSettings(**bad)
