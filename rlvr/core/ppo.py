"""PPO's critic side: generalized advantage estimation and the clipped value loss (pure torch).

Shapes: N completions, T completion tokens, ``mask`` [N, T] 1 on real tokens (right-padded). A completion is
an episode whose t-th action is its t-th token; the state before token t is valued by the critic as V_t.

    delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last real token is 0: the episode ends)
    A_t     = sum_l (gamma * lambda)^l * delta_{t+l}
    R_t     = A_t + V_t                              (the value target)

The verifiable reward arrives at the last real token; a per-token KL penalty may be added to every r_t
(``token_rewards``). Departures: none from the standard (Schulman et al. 2016; the PPO-for-LLMs recipe of
InstructGPT / TRL's PPOTrainer); advantage whitening is optional and over the real tokens of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PPOSettings:
    """PPO's critic-side knobs (the run config's ``ppo`` section is this class)."""

    gamma: float = 1.0
    """Discount over the tokens of a completion."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: float = 0.05
    """KL penalty to the reference policy in the per-token reward (k1 estimate; 0: none, no reference pass)."""
    value_clip: float = 0.2
    """Clip of the value update around the old values (0: unclipped)."""
    vf_coef: float = 0.5
    """Weight of the value loss in the combined loss."""
    whiten: bool = True
    """Whiten the advantages over the tokens of the batch."""

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1]; got {getattr(self, name)}")
        for name in ("kl_coef", "value_clip", "vf_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")


def token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards [N, T]: ``rewards`` [N] at each completion's last real token, minus ``kl_coef * kl``
    [N, T] on every real token."""
    lengths = mask.sum(-1).long()  # [N]
    out = torch.zeros(mask.shape, dtype=torch.float64 if rewards.dtype == torch.float64 else torch.float32,
                      device=mask.device)
    rows = torch.arange(mask.shape[0], device=mask.device)[lengths > 0]
    out[rows, lengths[lengths > 0] - 1] = rewards[lengths > 0].to(out.dtype)
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.to(out.dtype) * mask
    return out * mask


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns [N, T] from per-token rewards and values [N, T] (0 on padding)."""
    m = mask.to(values.dtype)
    values = values * m
    adv = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m[:, t]  # padding resets it: the episode has ended
        adv[:, t] = running
    return adv, (adv + values) * m


def whiten(adv: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Advantages [N, T] shifted and scaled to mean 0, std 1 over the real tokens."""
    m = mask.bool()
    x = adv[m]
    if x.numel() < 2:
        return adv * mask
    return ((adv - x.mean()) / (x.std() + eps)) * mask


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float = 0.2
) -> torch.Tensor:
    """Per-token clipped value loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), elementwise
    (no clipping when ``clip`` is 0)."""
    unclipped = (values - returns) ** 2
    if not clip:
        return 0.5 * unclipped
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(unclipped, (clipped_values - returns) ** 2)
