"""Off-policy corrections: the batch was sampled by a behaviour policy that is not the one being trained.

Three policies take part in an update (all log-probs are of the sampled tokens, at the sampling temperature):
    pi_theta   the weights being optimised (carries gradient)
    pi_prox    the proximal policy: the trainer's weights when the step began (frozen); with one optimizer pass
               per batch (mu = 1) it *is* pi_theta, detached, and costs nothing
    pi_behav   the behaviour policy that sampled the tokens: an older adapter, another engine (vLLM), bf16
               kernels; its log-probs are recorded by the sampler

What each knob computes (rho = pi_prox / pi_behav; A = advantage; eps = PPO clip range):
- ratio_to="proximal" (AReaL's decoupled PPO):  r = pi_theta / pi_prox
      per-token loss = -w * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
  with an importance weight w that corrects for pi_behav != pi_prox:
      is_level="token"    w_t = rho_t = exp(logp_prox_t - logp_behav_t)
      is_level="sequence" w_t = prod_t rho_t over the token's completion (verl's sequence-level rollout IS)
      is_level="none"     w = 1 (no correction: correct only when pi_behav == pi_prox)
      is_mode="truncate"  w <- min(w, is_cap)                      (truncated IS, "TIS"; verl rollout_is)
      is_mode="mask"      w <- w if w <= is_cap else 0             (AReaL's behaviour-weight cap)
- ratio_to="behaviour" (TRL's async trainer, prime-rl):  r = pi_theta / pi_behav in the same clipped loss and
  no separate weight (the ratio already is the correction); is_level must then be "none".
- gap_mask=delta > 0 (the trust-region mask of DPPO, binary total variation, as prime-rl applies it): a token is
  dropped from the policy loss when its probability under pi_theta has moved more than delta away from
  pi_behav in the direction its advantage pushes: (A > 0 and p_theta - p_behav > delta) or
  (A < 0 and p_behav - p_theta > delta).
The weights are constants (no gradient flows through w); the KL penalty is not weighted or masked.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

RatioTo = Literal["proximal", "behaviour"]
RATIO_TO = ("proximal", "behaviour")
ISLevel = Literal["none", "token", "sequence"]
IS_LEVELS = ("none", "token", "sequence")
ISMode = Literal["truncate", "mask"]
IS_MODES = ("truncate", "mask")
MAX_LOG_WEIGHT = 20.0  # exp(20) ~ 5e8: a bound that keeps sequence weights finite before they are capped


def sequence_log_ratio(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per completion, sum_t mask * (logp_prox - logp_behav); [N, T] inputs -> [N]."""
    return ((proximal_logp - behaviour_logp) * mask).sum(dim=-1)


def importance_weight(log_weight: torch.Tensor, mode: ISMode, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Capped importance weights from log-weights (any shape); returns (weights, capped flags), both detached.

    truncate: min(w, cap); mask: w where w <= cap, else 0. ``capped`` marks the entries where w > cap.
    """
    w = torch.exp(log_weight.detach().clamp(max=MAX_LOG_WEIGHT))
    capped = w > cap
    if mode == "truncate":
        return w.clamp(max=cap), capped
    if mode == "mask":
        return torch.where(capped, torch.zeros_like(w), w), capped
    raise ValueError(f"is_mode must be one of {IS_MODES}, got {mode!r}")


def floored_behaviour_logp(behaviour_logp: torch.Tensor, logp: torch.Tensor, cap: float) -> torch.Tensor:
    """max(logp_behav, logp - log cap) elementwise: behaviour log-probs no lower than ``logp`` (a policy's own,
    frozen) allows at ``cap``, so that pi / pi_behav <= cap wherever pi is that policy. With ratio_to="behaviour"
    the ratio is the correction and no weight caps it; a receiver that cannot vouch for pi_behav (a peer's log-probs,
    rlvr/run/shared_rollouts.py) floors them at its own log-probs first, and the ratio then starts at most at cap."""
    return torch.maximum(behaviour_logp, (logp.detach() - math.log(cap)).to(behaviour_logp.dtype))


def gap_mask(logp: torch.Tensor, behaviour_logp: torch.Tensor, adv: torch.Tensor, delta: float) -> torch.Tensor:
    """True where a token stays in the policy loss under the probability-gap trust region (see module docstring).

    logp, behaviour_logp: same shape; adv broadcastable to it. delta <= 0 keeps every token.
    """
    if delta <= 0:
        return torch.ones_like(logp, dtype=torch.bool)
    gap = torch.exp(logp.detach()) - torch.exp(behaviour_logp)
    too_far = ((adv > 0) & (gap > delta)) | ((adv < 0) & (gap < -delta))
    return ~too_far
