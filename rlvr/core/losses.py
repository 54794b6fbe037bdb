"""Clipped policy-gradient loss, KL penalty, off-policy weights and loss aggregation (pure torch, no state).

Shapes: N completions in the (micro-)batch, T completion tokens (right-padded), ``mask`` [N, T] is 1 on the
tokens that are trained (the loss mask). Per-token functions also accept the real tokens flattened to [M].

Notes on departures and choices:
- The KL term is added per token to the surrogate before aggregation (as DeepSeekMath writes it),
  not to the reward; it is neither importance-weighted nor masked by the off-policy correction.
- ``aggregation`` fixes how per-token losses become one number. Every mode divides by a normaliser
  computed once per optimizer step over the whole batch (``loss_normaliser``) and only *sums* inside a
  micro-batch, so splitting a batch into micro-batches never changes the gradient:
    sequence_mean       sum_i (1/|o_i|) sum_t l_it / #sequences          (original GRPO)
    token_mean          sum_i sum_t l_it / #tokens                       (DAPO)
    token_sum_constant  sum_i sum_t l_it / (max_new_tokens * #sequences) (Dr. GRPO)
- Statistics are returned as per-token tensors and reduced to sums and maxima (``stat_sums``), so they
  add up exactly across micro-batches and chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlvr.core.off_policy import (
    IS_LEVELS,
    IS_MODES,
    RATIO_TO,
    ISLevel,
    ISMode,
    RatioTo,
    gap_mask,
    importance_weight,
)

Aggregation = Literal["sequence_mean", "token_mean", "token_sum_constant"]
AGGREGATIONS = ("sequence_mean", "token_mean", "token_sum_constant")
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class LossSettings:
    """The knobs of the per-token objective; presets are named values of these (see rlvr.core.off_policy for
    the off-policy ones). The run config's ``algo`` section inherits these fields, docstrings and checks; a check's
    message starts with the field's name, so the config can prefix it with ``algo.``."""

    eps_low: float = 0.2
    """Lower clip: ratio >= 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip: ratio <= 1 + eps_high (DAPO clip-higher raises it)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1: for negative advantages the loss is capped at c * |A| (0 disables)."""
    beta: float = 0.0
    """KL coefficient; 0 skips the reference forward entirely (the grpo preset sets 0.04)."""
    kl_estimator: KLEstimator = "k3"
    """k1, k2 or k3 (Schulman's estimators of KL(policy || reference))."""
    aggregation: Aggregation = "sequence_mean"
    """Loss aggregation: sequence_mean (GRPO), token_mean (DAPO), token_sum_constant (Dr. GRPO)."""
    ratio_to: RatioTo = "proximal"
    """Denominator of the clipped ratio: proximal (the weights as the step began; AReaL's decoupled PPO) or
    behaviour (the policy that sampled the tokens, as TRL's async trainer and prime-rl do)."""
    is_level: ISLevel = "token"
    """Importance weight pi_prox / pi_behav on the clipped loss, per token, per sequence, or none (only with
    ratio_to=proximal). On-policy it is 1 up to numerics; for stale or foreign samples it is the correction."""
    is_mode: ISMode = "truncate"
    """Weights above is_cap are truncated to it (TIS, verl's rollout_is) or masked to 0 (AReaL)."""
    is_cap: float = 2.0
    """Cap C >= 1 of the importance weight."""
    gap_mask: float = 0.0
    """Drop tokens whose probability moved more than this from the behaviour policy in the direction of their
    advantage (DPPO's binary-TV trust region, as in prime-rl); 0 disables."""

    def __post_init__(self) -> None:
        for name, value, allowed in (("aggregation", self.aggregation, AGGREGATIONS),
                                     ("kl_estimator", self.kl_estimator, KL_ESTIMATORS),
                                     ("ratio_to", self.ratio_to, RATIO_TO), ("is_level", self.is_level, IS_LEVELS),
                                     ("is_mode", self.is_mode, IS_MODES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        if self.ratio_to == "behaviour" and self.is_level != "none":
            raise ValueError(
                "ratio_to='behaviour' already divides by the behaviour policy; an importance weight on top would "
                "correct twice: set is_level='none', or ratio_to='proximal' for the decoupled objective"
            )
        check_dual_clip(self.dual_clip)
        if self.is_cap < 1:
            raise ValueError(f"is_cap must be >= 1; got {self.is_cap}")
        if not 0 <= self.gap_mask < 1:
            raise ValueError(f"gap_mask is a probability gap in [0, 1); got {self.gap_mask}")


def check_dual_clip(c: float) -> None:
    """The one check of the dual-clip constant: c > 1, or 0 (disabled)."""
    if c and c <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or 0 to disable); got {c}")


@dataclass
class TokenInputs:
    """Per-token tensors of one (micro-)batch; every field has the shape of ``logp`` ([M] or [N, T])."""

    logp: torch.Tensor  # pi_theta, carries gradient
    behaviour_logp: torch.Tensor  # pi_behav, recorded by the sampler
    adv: torch.Tensor  # each token's advantage (broadcastable: [N, 1] for one per completion)
    proximal_logp: torch.Tensor | None = None  # pi_prox; None: the current weights are it (mu = 1)
    ref_logp: torch.Tensor | None = None  # reference policy; needed iff beta != 0
    sequence_log_weight: torch.Tensor | None = None  # sum of log pi_prox/pi_behav over the token's completion


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
    dual_clip: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-style clipped per-token loss (to minimise), elementwise.

    Args:
        logp: [N, T] (or any shape) current log-probs (carry gradient).
        old_logp: same shape, log-probs of the ratio's denominator policy.
        adv: advantages broadcastable to logp: [N, 1] for one per completion, or one per token.
        dual_clip: c > 1 caps the loss of negative advantages at c * |A|; 0 disables it.
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
    check_dual_clip(dual_clip)
    if dual_clip:
        cap = -a * dual_clip  # positive where a < 0
        flags["clip_dual"] = (a < 0) & (loss > cap)
        loss = torch.where(a < 0, torch.minimum(loss, cap), loss)
    return loss, flags


def token_objective(x: TokenInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss  keep * w * clipped_surrogate(r, A) + beta * KL,  elementwise (see rlvr.core.off_policy).

    Returns the loss (shaped like ``x.logp``) and per-token statistics: boolean ``clip_low``, ``clip_high``
    (``clip_dual``), ``is_capped``, ``gap_masked``; float ``is_weight`` (rho = pi_prox/pi_behav per token),
    ``logp_gap`` (|logp_prox - logp_behav|) and ``kl`` (when beta != 0).
    """
    s = settings
    prox = x.logp.detach() if x.proximal_logp is None else x.proximal_logp
    anchor = x.behaviour_logp if s.ratio_to == "behaviour" else prox
    loss, stats = clipped_surrogate(x.logp, anchor, x.adv, s.eps_low, s.eps_high, s.dual_clip)
    token_log_weight = (prox - x.behaviour_logp).detach()
    if s.is_level != "none":
        if s.is_level == "sequence":
            if x.sequence_log_weight is None:
                raise ValueError("is_level='sequence' needs sequence_log_weight (see off_policy.sequence_log_ratio)")
            log_weight = x.sequence_log_weight
        else:
            log_weight = token_log_weight
        weight, stats["is_capped"] = importance_weight(log_weight, s.is_mode, s.is_cap)
        loss = loss * weight
    else:
        stats["is_capped"] = torch.zeros_like(loss, dtype=torch.bool)
    keep = gap_mask(x.logp, x.behaviour_logp, x.adv, s.gap_mask).expand_as(loss)
    stats["gap_masked"] = ~keep
    loss = torch.where(keep, loss, torch.zeros_like(loss))
    stats["is_weight"] = torch.exp(token_log_weight.clamp(max=20.0)).expand_as(loss)
    stats["logp_gap"] = token_log_weight.abs().expand_as(loss)
    if s.beta != 0.0:
        if x.ref_logp is None:
            raise ValueError("beta != 0 needs ref_logp")
        kl = kl_penalty(x.logp, x.ref_logp, s.kl_estimator)
        stats["kl"] = kl.detach()
        loss = loss + s.beta * kl
    return loss, stats


def stat_sums(stats: dict[str, torch.Tensor], mask: torch.Tensor | None = None) -> dict[str, float]:
    """Reduce per-token statistics over the tokens in ``mask`` (all when None): counts and sums, plus
    ``is_weight_max``; ``tokens`` is the number of tokens. Merge several with ``merge_stat_sums``."""
    m = torch.ones_like(stats["is_weight"], dtype=torch.bool) if mask is None else mask.bool()
    out = {name: float(v[m].sum()) for name, v in stats.items()}
    out["tokens"] = float(m.sum())
    out["is_weight_max"] = float(stats["is_weight"][m].max()) if m.any() else 0.0
    return out


def merge_stat_sums(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """Add ``part`` into ``total`` (maxima take the max); returns ``total``."""
    for k, v in part.items():
        total[k] = max(total.get(k, v), v) if k.endswith("_max") else total.get(k, 0.0) + v
    return total


def loss_normaliser(mask: torch.Tensor, aggregation: Aggregation, max_new_tokens: int) -> float:
    """The divisor for one optimizer step, from the loss mask of the *whole* batch. mask: [N, T]."""
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


def policy_loss(
    x: TokenInputs, mask: torch.Tensor, settings: LossSettings, normaliser: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """The whole objective for one micro-batch of [N, T] tensors (the plain composition; the trainer runs the
    same per-token objective inside the fused output layer).

    Args:
        x: [N, T] log-probs of the sampled tokens; ``x.adv`` [N, 1] or [N, T].
        mask: [N, T] loss mask; normaliser: from ``loss_normaliser`` over the whole optimizer batch.
    Returns:
        scalar loss (this micro-batch's additive share) and the statistics' sums over the mask.
    """
    per_token, stats = token_objective(x, settings)
    return aggregate(per_token, mask, settings.aggregation, normaliser), stat_sums(stats, mask)
