"""The per-token loss around an objective, the KL penalty, and the loss aggregation (pure torch, no state).

Shapes: N completions in the (micro-)batch, T completion tokens (right-padded), ``mask`` [N, T] is 1 on the
tokens that are trained (the loss mask).

    token_loss   = keep * w * objective(x) + beta * KL          per token (objectives: rlvr/core/objectives.py)
    policy_loss  = aggregate(token_loss) - entropy_coef * mean entropy of the step's trained tokens

Notes on departures and choices:
- The KL term is added per token to the policy term before aggregation (as DeepSeekMath writes it), not to the
  reward; it is neither importance-weighted nor masked (TRL adds it after its masks too). ``kl_ratio_weighted``
  multiplies it by the objective's ratio pi_theta / pi_old (``kl_ratio``), as TRL 1.16 does by default
  (use_bias_correction_kl); off, the plain estimator (rlvr's config default).
- ``w`` is the off-policy importance weight and ``keep`` the trust-region and top-entropy masks
  (rlvr/core/off_policy.py); no gradient flows through either.
- ``aggregation`` fixes how per-token losses become one number. Every mode divides by a normaliser computed once
  per optimizer step over the whole batch (``loss_normaliser``) and only *sums* inside a micro-batch, so splitting
  a batch into micro-batches never changes the gradient:
    sequence_mean       sum_i (1/|o_i|) sum_t l_it / #sequences          (GRPO, GSPO, SAPO)
    token_mean          sum_i sum_t l_it / #tokens                       (DAPO, CISPO)
    token_sum_constant  sum_i sum_t l_it / (max_new_tokens * #sequences) (Dr. GRPO)
    sequence_sum        sum_i sum_t l_it / #sequences                    (LUSPO)
- The entropy bonus is a mean over the step's trained tokens whatever the aggregation (TRL's entropy_coef).
- Statistics are returned as per-token tensors and reduced to sums and maxima (``stat_sums``), so they add up
  exactly across micro-batches. Each is named as it is reported: the step reports ``NAME`` as its sum over the
  trained tokens divided by ``tokens`` (a mean, or a fraction of booleans), and a ``NAME_max`` as it stands, so an
  objective's own statistic reaches the metrics without the step knowing it.
"""

from __future__ import annotations

import torch

from rlvr.core.objectives import OBJECTIVES, TokenBatch
from rlvr.core.off_policy import gap_mask, importance_weight, sequence_log_ratio
from rlvr.core.settings import AGGREGATIONS, KL_ESTIMATORS, Aggregation, KLEstimator, LossSettings


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


def kl_ratio(x: TokenBatch, old: torch.Tensor, sequence: bool) -> torch.Tensor:
    """pi_theta / pi_old per token [N, T] (pi_old: the objective's denominator, ``TokenBatch.old_logp``), with the
    gradient of log pi_theta; ``sequence``: the length-normalised sequence ratio exp(mean_t log ratio) per
    completion, [N, 1] (TRL's coef_1 before any clamp)."""
    log_ratio = x.logp - old.detach()
    if sequence:
        log_ratio = (log_ratio * x.mask).sum(-1, keepdim=True) / x.mask.sum(-1, keepdim=True).clamp(min=1)
    return torch.exp(log_ratio)


def token_loss(x: TokenBatch, s: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss  keep * w * objective(x) + beta * KL,  [N, T] (see the module docstring).

    Returns the loss and per-token statistics: the objective's flags (``clip_low``, ``clip_high``, ...), boolean
    ``is_capped_frac``, ``gap_masked_frac`` (and ``entropy_masked_frac``), float ``is_weight_mean`` (rho =
    pi_prox/pi_behav per token),
    ``logp_gap`` (|logp_prox - logp_behav|) and ``kl`` (when beta != 0).
    """
    loss, stats = OBJECTIVES[s.objective](x, s)
    prox = x.logp.detach() if x.proximal_logp is None else x.proximal_logp
    token_log_weight = (prox - x.behaviour_logp).detach()
    if s.is_level != "none":
        log_weight = token_log_weight
        if s.is_level == "sequence":
            log_weight = sequence_log_ratio(prox.detach(), x.behaviour_logp, x.mask)[:, None].expand_as(loss)
        weight, stats["is_capped_frac"] = importance_weight(log_weight, s.is_mode, s.is_cap)
        loss = loss * weight
    else:
        stats["is_capped_frac"] = torch.zeros_like(loss, dtype=torch.bool)
    keep = gap_mask(x.logp, x.behaviour_logp, x.adv, s.gap_mask).expand_as(loss)
    stats["gap_masked_frac"] = ~keep
    loss = torch.where(keep, loss, torch.zeros_like(loss))
    if x.high_entropy is not None:
        stats["entropy_masked_frac"] = ~x.high_entropy
        loss = torch.where(x.high_entropy, loss, torch.zeros_like(loss))
    stats["is_weight_mean"] = torch.exp(token_log_weight.clamp(max=20.0)).expand_as(loss)
    stats["logp_gap"] = token_log_weight.abs().expand_as(loss)
    if s.beta != 0.0:
        if x.ref_logp is None:
            raise ValueError("beta != 0 needs ref_logp")
        kl = kl_penalty(x.logp, x.ref_logp, s.kl_estimator)
        stats["kl"] = kl.detach()
        if s.kl_ratio_weighted:
            kl = kl * kl_ratio(x, x.old_logp(s.ratio_to), s.objective == "gspo")
        loss = loss + s.beta * kl
    return loss, stats


def loss_normaliser(mask: torch.Tensor, aggregation: Aggregation, max_new_tokens: int,
                    every_row: bool = False) -> float:
    """The divisor for one optimizer step, from the loss mask of the *whole* batch. mask: [N, T]. The per-sequence
    aggregations count the rows with a trained token, or, with ``every_row``, all N (TRL's count)."""
    lengths = mask.sum(dim=-1)
    sequences = mask.shape[0] if every_row else int((lengths > 0).sum())
    if aggregation in ("sequence_mean", "sequence_sum"):
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


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation, normaliser: float) -> torch.Tensor:
    """Sum per-token losses [N, T] over the trained tokens of ``mask`` into this micro-batch's share of the step's
    loss (summed in the order of the trained tokens, row by row)."""
    weighted = per_token * token_weights(mask.to(per_token.dtype), aggregation, normaliser)
    return weighted[mask.bool()].sum()


def policy_loss(x: TokenBatch, s: LossSettings, normaliser: float, step_tokens: float
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's additive share of the step's loss, and its statistics summed over ``x.mask``.

    Args:
        x: the micro-batch's [N, T] tensors; ``x.entropy`` is needed when entropy_coef != 0.
        normaliser: ``loss_normaliser`` of the whole optimizer batch; step_tokens: its trained tokens.
    """
    per_token, stats = token_loss(x, s)
    loss = aggregate(per_token, x.mask, s.aggregation, normaliser)
    if s.entropy_coef:
        if x.entropy is None:
            raise ValueError("entropy_coef != 0 needs the entropy of each token (TokenBatch.entropy)")
        loss = loss - s.entropy_coef * (x.entropy * x.mask)[x.mask.bool()].sum() / max(step_tokens, 1.0)
    return loss, stat_sums(stats, x.mask)


def stat_sums(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """Reduce per-token statistics over the tokens in ``mask``: counts and sums, plus ``is_weight_max``; ``tokens``
    is the number of tokens (a statistic's sum / ``tokens`` is what the step reports under its name). Merge several
    with ``merge_stat_sums``."""
    m = mask.bool()
    out = {name: float(v[m].sum()) for name, v in stats.items()}
    out["tokens"] = float(m.sum())
    out["is_weight_max"] = float(stats["is_weight_mean"][m].max()) if m.any() else 0.0
    return out


def merge_stat_sums(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """Add ``part`` into ``total`` (maxima take the max); returns ``total``."""
    for k, v in part.items():
        total[k] = max(total.get(k, v), v) if k.endswith("_max") else total.get(k, 0.0) + v
    return total
