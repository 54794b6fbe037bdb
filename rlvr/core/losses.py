"""Clipped policy-gradient loss, KL penalty and loss aggregation (pure torch, no state).

Shapes: N completions in the (micro-)batch, T completion tokens (right-padded), ``mask`` [N, T] is 1 on
real completion tokens.

Notes on departures and choices:
- The KL term is added per token to the surrogate before aggregation (as DeepSeekMath writes it),
  not to the reward.
- ``aggregation`` fixes how per-token losses become one number. Every mode divides by a normaliser
  computed once per optimizer step over the whole batch (``loss_normaliser``) and only *sums* inside a
  micro-batch, so splitting a batch into micro-batches never changes the gradient:
    sequence_mean       sum_i (1/|o_i|) sum_t l_it / #sequences          (original GRPO)
    token_mean          sum_i sum_t l_it / #tokens                       (DAPO)
    token_sum_constant  sum_i sum_t l_it / (max_new_tokens * #sequences) (Dr. GRPO)
- Clip statistics are returned as token *counts*, so they also add up exactly across micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["sequence_mean", "token_mean", "token_sum_constant"]
AGGREGATIONS = ("sequence_mean", "token_mean", "token_sum_constant")
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class LossSettings:
    """The knobs of the per-token objective; presets are named values of these."""

    eps_low: float = 0.2  # ratio floor is 1 - eps_low
    eps_high: float = 0.2  # ratio ceiling is 1 + eps_high (DAPO "clip-higher" raises it)
    dual_clip: float | None = None  # c > 1: for A < 0 the loss is capped at c * |A| (dual-clip PPO)
    beta: float = 0.0  # KL coefficient; 0 means no reference pass at all
    kl_estimator: KLEstimator = "k3"
    aggregation: Aggregation = "sequence_mean"


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3).

    With log-ratio x = ref_logp - logp: k1 = -x, k2 = x^2 / 2, k3 = exp(x) - 1 - x.
    logp, ref_logp: [N, T] -> [N, T].
    """
    x = ref_logp - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.expm1(x) - x
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-style clipped per-token loss (to minimise), elementwise.

    Args:
        logp: [N, T] (or any shape) current log-probs (carry gradient).
        old_logp: same shape, log-probs of the policy that sampled the tokens.
        adv: advantages broadcastable to logp: [N, 1] for one per completion, or one per token.
    Returns:
        loss and boolean masks, shaped like logp: ``clip_low`` (ratio < 1-eps_low with A < 0),
        ``clip_high`` (ratio > 1+eps_high with A > 0), ``clip_dual`` (dual clip active).
    """
    a = adv
    ratio = torch.exp(logp - old_logp)
    unclipped = -a * ratio
    clipped = -a * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    flags = {
        "clip_low": (ratio < 1.0 - eps_low) & (a < 0),
        "clip_high": (ratio > 1.0 + eps_high) & (a > 0),
    }
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -a * dual_clip  # positive where a < 0
        flags["clip_dual"] = (a < 0) & (loss > cap)
        loss = torch.where(a < 0, torch.minimum(loss, cap), loss)
    return loss, flags


def loss_normaliser(mask: torch.Tensor, aggregation: Aggregation, max_new_tokens: int) -> float:
    """The divisor for one optimizer step, from the mask of the *whole* batch. mask: [N, T]."""
    lengths = mask.sum(dim=-1)
    sequences = int((lengths > 0).sum())
    if aggregation == "sequence_mean":
        value = sequences
    elif aggregation == "token_mean":
        value = int(lengths.sum())
    elif aggregation == "token_sum_constant":
        value = max_new_tokens * sequences
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    return float(max(value, 1))


def token_weights(mask: torch.Tensor, aggregation: Aggregation, normaliser: float) -> torch.Tensor:
    """Weights [N, T] such that sum(weights * per_token) is the micro-batch's share of the step's loss."""
    mask = mask.to(torch.get_default_dtype() if not mask.is_floating_point() else mask.dtype)
    if aggregation == "sequence_mean":
        mask = mask / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    elif aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    return mask / normaliser


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation, normaliser: float
) -> torch.Tensor:
    """Sum per-token losses [N, T] under ``mask`` into this micro-batch's share of the step's loss."""
    return (per_token * token_weights(mask.to(per_token.dtype), aggregation, normaliser)).sum()


def token_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    adv: torch.Tensor,
    settings: LossSettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """Per-token loss (surrogate + beta * KL), elementwise; adv broadcastable to logp.

    Returns the loss, the clip masks, and the KL estimate (None when beta == 0).
    """
    loss, flags = clipped_surrogate(logp, old_logp, adv, settings.eps_low, settings.eps_high, settings.dual_clip)
    kl = None
    if settings.beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta != 0 needs ref_logp")
        kl = kl_penalty(logp, ref_logp, settings.kl_estimator)
        loss = loss + settings.beta * kl
    return loss, flags, kl


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    normaliser: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole objective for one micro-batch.

    Args:
        logp, old_logp, ref_logp: [N, T] log-probs of the sampled tokens (ref_logp None iff beta == 0).
        adv: [N]; mask: [N, T]; normaliser: from ``loss_normaliser`` over the whole optimizer batch.
    Returns:
        scalar loss (this micro-batch's additive share) and detached token counts/sums for logging:
        tokens, clip_low, clip_high, clip_dual, kl_sum.
    """
    per_token, flags, kl = token_objective(logp, old_logp, ref_logp, adv[:, None], settings)
    m = mask.bool()
    stats = {name: (flag & m).sum().detach() for name, flag in flags.items()}
    stats["tokens"] = m.sum().detach()
    if kl is not None:
        stats["kl_sum"] = (kl.detach() * mask).sum()
    return aggregate(per_token, mask, settings.aggregation, normaliser), stats
