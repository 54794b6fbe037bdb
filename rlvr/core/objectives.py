"""Policy objectives: one pure function per objective, all with one contract.

    objective(x: TokenBatch, s: LossSettings) -> (loss [N, T] to minimise, per-token statistics)

``x`` holds [N, T] tensors of one micro-batch (N completions, T completion tokens, right-padded; ``x.mask`` is 1 on
the trained tokens). An objective returns the per-token *policy* term only: the off-policy weight, the masks and
the KL penalty are applied around it (``rlvr.core.losses.token_loss``) and the aggregation divides by a normaliser
fixed once per optimizer step (``rlvr.core.losses.aggregate``). Each docstring names the paper and the
normalisation it uses; rlvr's presets of the same name set that normalisation (``algo.aggregation``).

Notation: r_t = pi_theta / pi_old per token (pi_old: the proximal policy, or the behaviour policy with
ratio_to=behaviour), A the advantage, eps_low / eps_high the clip range, sg[.] stop-gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlvr.core.settings import OBJECTIVE_NAMES, LossSettings

Stats = dict[str, torch.Tensor]


@dataclass
class TokenBatch:
    """The per-token tensors of one micro-batch; every field is [N, T] (``adv`` may be [N, 1])."""

    logp: torch.Tensor  # log pi_theta of the sampled tokens; carries gradient
    behaviour_logp: torch.Tensor  # log pi_behav, recorded by the sampler
    adv: torch.Tensor  # advantage per token, or [N, 1] per completion
    mask: torch.Tensor  # 1 on the tokens that are trained (float)
    proximal_logp: torch.Tensor | None = None  # log pi_prox, frozen; None: the current weights are it (mu = 1)
    ref_logp: torch.Tensor | None = None  # reference policy; needed iff beta != 0
    entropy: torch.Tensor | None = None  # entropy of each position's distribution; carries gradient
    high_entropy: torch.Tensor | None = None  # bool: the token is in the step's top entropy quantile

    def old_logp(self, ratio_to: str) -> torch.Tensor:
        """The ratio's denominator: pi_behav (ratio_to=behaviour) or pi_prox (frozen)."""
        if ratio_to == "behaviour":
            return self.behaviour_logp
        return self.logp.detach() if self.proximal_logp is None else self.proximal_logp


def _clip_flags(ratio: torch.Tensor, adv: torch.Tensor, s: LossSettings) -> Stats:
    return {"clip_low": (ratio < 1.0 - s.eps_low) & (adv < 0), "clip_high": (ratio > 1.0 + s.eps_high) & (adv > 0)}


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, s: LossSettings) -> tuple[torch.Tensor, Stats]:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) elementwise, with dual clip c > 1: a negative advantage's
    loss is capped at c |A| (``s.dual_clip``; 0: off). Flags ``clip_low``, ``clip_high`` (``clip_dual``)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - s.eps_low, 1.0 + s.eps_high)
    loss = torch.maximum(unclipped, clipped)
    flags = _clip_flags(ratio, adv, s)
    if s.dual_clip:
        cap = -adv * s.dual_clip  # positive where adv < 0
        flags["clip_dual"] = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return loss, flags


def ppo_clip(x: TokenBatch, s: LossSettings) -> tuple[torch.Tensor, Stats]:
    """GRPO (DeepSeekMath, arXiv 2402.03300), DAPO (2503.14476), Dr. GRPO (2503.20783): PPO's clipped token ratio,
        L_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A).
    The three differ in normalisation: per sequence then over sequences (grpo), over the step's tokens (dapo), over
    max_new_tokens x sequences (dr_grpo)."""
    return clipped_surrogate(torch.exp(x.logp - x.old_logp(s.ratio_to)), x.adv, s)


def sequence_ratio(x: TokenBatch, s: LossSettings) -> torch.Tensor:
    """GSPO's s_i = exp(mean_t log r_t) over each completion's trained tokens, [N, 1] (carries gradient)."""
    log_ratio = torch.where(x.mask.bool(), x.logp - x.old_logp(s.ratio_to), 0.0)  # [N, T], 0 off the mask
    return torch.exp(log_ratio.sum(-1, keepdim=True) / x.mask.sum(-1, keepdim=True).clamp(min=1.0))


def gspo(x: TokenBatch, s: LossSettings) -> tuple[torch.Tensor, Stats]:
    """GSPO (Qwen, arXiv 2507.18071): the clipped surrogate on the length-normalised sequence ratio s_i, the same
    for every token of completion i:  L_t = -min(s_i A, clip(s_i, 1 - eps_low, 1 + eps_high) A).
    Paper normalisation: the mean over sequences of the sequence loss (sequence_mean: each token carries it once,
    divided by the length); a token-summing aggregation would weight each sequence by its length. The paper's clip
    range is 3e-4 / 4e-4 (preset gspo). LUSPO (arXiv 2602.05261) is this objective with sequence_sum."""
    ratio = sequence_ratio(x, s).expand_as(x.logp)
    return clipped_surrogate(ratio, x.adv, s)


def gspo_token(x: TokenBatch, s: LossSettings) -> tuple[torch.Tensor, Stats]:
    """GSPO-token (arXiv 2507.18071, section 4.3): s_it = sg[s_i] pi_theta(t) / sg[pi_theta(t)], equal to s_i in
    value with gradient s_i grad log pi_theta(t); the same as GSPO unless advantages vary within a completion.
    Normalisation as GSPO (sequence_mean)."""
    ratio = sequence_ratio(x, s).detach() * torch.exp(x.logp - x.logp.detach())
    return clipped_surrogate(ratio, x.adv, s)


def cispo(x: TokenBatch, s: LossSettings) -> tuple[torch.Tensor, Stats]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by the clipped, detached ratio, so no token loses
    its gradient:  L_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] A log pi_theta(t).
    The bounds are the paper's (1 -/+ an offset); TRL's epsilon_high is the absolute upper bound instead (5.0 in
    its docs is eps_high = 4 here). Paper normalisation: over the step's tokens (token_mean; preset cispo: no
    lower bound, eps_low = 1, and eps_high = 4)."""
    ratio = torch.exp(x.logp.detach() - x.old_logp(s.ratio_to))
    weight = ratio.clamp(1.0 - s.eps_low, 1.0 + s.eps_high)
    return -weight * x.adv * x.logp, _clip_flags(ratio, x.adv, s)


def sapo(x: TokenBatch, s: LossSettings) -> tuple[torch.Tensor, Stats]:
    """SAPO (Qwen, arXiv 2511.20347): a soft gate instead of the hard clip,
        L_t = -(4 / tau) sigmoid(tau (r_t - 1)) A,   tau = sapo_tau_pos if A > 0 else sapo_tau_neg,
    whose gradient in r is 4 sigmoid (1 - sigmoid): 1 on-policy, decaying smoothly as r leaves 1. Normalisation
    as GRPO (sequence_mean)."""
    ratio = torch.exp(x.logp - x.old_logp(s.ratio_to))
    tau = torch.full_like(x.adv, s.sapo_tau_neg).masked_fill(x.adv > 0, s.sapo_tau_pos)  # the advantage's dtype
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * x.adv
    no_clip = torch.zeros_like(loss, dtype=torch.bool)
    return loss, {"clip_low": no_clip, "clip_high": no_clip}


Objective = Callable[[TokenBatch, LossSettings], tuple[torch.Tensor, Stats]]
OBJECTIVES: dict[str, Objective] = {
    "ppo_clip": ppo_clip, "gspo": gspo, "gspo_token": gspo_token, "cispo": cispo, "sapo": sapo,
}
assert tuple(OBJECTIVES) == OBJECTIVE_NAMES
