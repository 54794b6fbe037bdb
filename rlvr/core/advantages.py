"""Group-relative advantages: compare each completion with the other completions of its own prompt.

Departures from the paper, stated plainly:
- DeepSeekMath's GRPO divides by the group's standard deviation; we use the unbiased estimate
  (ddof=1, as TRL and most open implementations do), so ``|A| <= (G-1)/sqrt(G) < sqrt(G)``.
- A group whose rewards are all equal (or that has fewer than two valid rewards) carries no signal:
  its advantages are exactly 0, never the ``0/eps`` noise or the inf/NaN a bare division gives.
- Missing rewards (NaN, from a verifier that returned None) are excluded: they do not enter the group
  mean or std, and their own advantage is 0.
"""

from __future__ import annotations

from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]
SCALES = ("group", "batch", "none")


def check_negative_scale(value: float) -> None:
    """The one check of ``negative_scale`` (``group_advantages``; the run config's algo.negative_scale)."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"negative_scale must be in [0, 1] (1: GRPO, 0: only better-than-average completions are "
                         f"reinforced); got {value}")


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: Scale = "group", eps: float = 1e-4, negative_scale: float = 1.0
) -> torch.Tensor:
    """Advantages from rewards laid out group after group.

    Args:
        rewards: [B*G] float; NaN marks a missing reward.
        group_size: G, completions per prompt.
        scale: "group" divides by each group's std (GRPO), "batch" by the std of all valid rewards in
            the batch, "none" only subtracts the group mean (Dr. GRPO).
        eps: added to the std so tiny-but-nonzero spreads stay finite.
        negative_scale: multiplies the advantages below 0 after scaling: 1 is GRPO; 0 reinforces only the
            completions better than their group's mean (rejection-sampling fine-tuning weighted by advantage);
            in between damps the push away from worse-than-average completions.

    Returns:
        [B*G] float advantages, 0 for missing rewards and for groups without spread.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    check_negative_scale(negative_scale)
    r = rewards.double().view(-1, group_size)  # [B, G]
    valid = ~torch.isnan(r)
    n = valid.sum(dim=1, keepdim=True)  # [B, 1]
    r0 = torch.where(valid, r, torch.zeros_like(r))
    mean = r0.sum(dim=1, keepdim=True) / n.clamp(min=1)
    centered = torch.where(valid, r0 - mean, torch.zeros_like(r))  # [B, G]
    has_signal = informative_groups(r.reshape(-1), group_size)[:, None]  # [B, 1]
    if scale == "group":
        var = centered.pow(2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
        adv = centered / (var.sqrt() + eps)
    elif scale == "batch":
        flat = r[valid]
        std = flat.std() if flat.numel() >= 2 else torch.zeros((), dtype=r.dtype, device=r.device)
        adv = centered / (std + eps)
    else:
        adv = centered
    adv = torch.where(adv < 0, adv * negative_scale, adv)
    adv = torch.where(has_signal & valid, adv, torch.zeros_like(adv))
    return adv.view(-1).to(rewards.dtype)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] bool: groups with at least two valid rewards that differ (a learning signal; the one test of it).
    rewards: [B*G], NaN where missing."""
    r = rewards.view(-1, group_size)
    valid = ~torch.isnan(r)
    lo = torch.where(valid, r, torch.full_like(r, float("inf"))).amin(dim=1)
    hi = torch.where(valid, r, torch.full_like(r, float("-inf"))).amax(dim=1)
    return (valid.sum(dim=1) >= 2) & (hi > lo)


def zero_variance_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose valid rewards are all equal (no learning signal). rewards: [B*G]."""
    return (~informative_groups(rewards, group_size)).float().mean().item()


def normalize_then_sum(rewards: torch.Tensor, weights: torch.Tensor, group_size: int, eps: float = 1e-4
                       ) -> torch.Tensor:
    """GDPO's advantages (arXiv 2601.05242; TRL's multi_objective_aggregation='normalize_then_sum'): each reward
    function normalised within its group first, so no function's scale drowns the others, then summed with its
    weight, then normalised over the batch.

        A_jk = (R_jk - mean_g R_k) / (std_g R_k + eps)      per function k, within completion j's group g
        r_j  = sum_k w_k A_jk                                 (a missing reward counts 0)
        A_j  = (r_j - mean r) / (std r + eps)                 over the batch's scored completions

    Args:
        rewards: [B*G, K] float, one column per reward function; NaN marks a missing reward.
        weights: [K] float.
    Returns:
        [B*G] float advantages; 0 where every function's reward is missing. Stds are unbiased (ddof = 1); a group
        with one valid reward or no spread in a function adds 0 for that function.
    """
    if rewards.dim() != 2 or rewards.shape[1] != weights.numel():
        raise ValueError(f"rewards must be [B*G, K] with K = {weights.numel()} reward functions; got "
                         f"{list(rewards.shape)}")
    per_function = torch.stack([group_advantages(rewards[:, k], group_size, "group", eps)
                                for k in range(rewards.shape[1])], dim=1).double()  # [B*G, K], 0 where missing
    scored = ~torch.isnan(rewards).all(dim=1)  # [B*G]
    total = (per_function * weights.double()).sum(dim=1)
    valid = total[scored]
    spread = valid.std() + eps if valid.numel() >= 2 else torch.zeros((), dtype=total.dtype, device=total.device)
    if spread == 0:  # fewer than two scored completions, or every sum equal: no signal
        return torch.zeros_like(total).to(rewards.dtype)
    adv = (total - valid.mean()) / spread
    return torch.where(scored, adv, torch.zeros_like(adv)).to(rewards.dtype)
