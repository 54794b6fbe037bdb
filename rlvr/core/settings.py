"""The knobs of the loss: which objective, its clip range, the off-policy correction, KL, entropy, aggregation.

The run config's ``algo`` section inherits these fields, their docstrings and their checks (a check's message starts
with the field's name, so the config prefixes it with ``algo.``); presets are named values of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlvr.core.off_policy import IS_LEVELS, IS_MODES, RATIO_TO, ISLevel, ISMode, RatioTo

Aggregation = Literal["sequence_mean", "token_mean", "token_sum_constant", "sequence_sum"]
AGGREGATIONS = ("sequence_mean", "token_mean", "token_sum_constant", "sequence_sum")
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS = ("k1", "k2", "k3")
ObjectiveName = Literal["ppo_clip", "gspo", "gspo_token", "cispo", "sapo"]
OBJECTIVE_NAMES = ("ppo_clip", "gspo", "gspo_token", "cispo", "sapo")


@dataclass(frozen=True)
class LossSettings:
    """The knobs of the per-token loss (rlvr.core.losses.token_loss) and of its aggregation."""

    objective: ObjectiveName = "ppo_clip"
    """The policy objective (rlvr/core/objectives.py): ppo_clip (GRPO, DAPO, Dr. GRPO), gspo (sequence-level ratio),
    gspo_token, cispo (clipped detached IS weight on REINFORCE), sapo (soft gate). LUSPO is gspo with
    aggregation=sequence_sum (preset luspo)."""
    eps_low: float = 0.2
    """Lower clip: ratio >= 1 - eps_low (cispo: the lower bound of its weight; 1 removes it)."""
    eps_high: float = 0.2
    """Upper clip: ratio <= 1 + eps_high (DAPO clip-higher raises it; cispo: the weight's cap is 1 + eps_high)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1: for negative advantages the loss is capped at c * |A| (0 disables; ppo_clip, gspo)."""
    sapo_tau_pos: float = 1.0
    """sapo: temperature of the soft gate for positive advantages (TRL: sapo_temperature_pos)."""
    sapo_tau_neg: float = 1.05
    """sapo: temperature for negative advantages (TRL: sapo_temperature_neg); above tau_pos, as the paper advises."""
    beta: float = 0.0
    """KL coefficient; 0 skips the reference forward entirely (the grpo preset sets 0.04)."""
    kl_estimator: KLEstimator = "k3"
    """k1, k2 or k3 (Schulman's estimators of KL(policy || reference))."""
    kl_ratio_weighted: bool = False
    """Multiply each token's KL estimate by the objective's ratio pi_theta / pi_old, with its gradient (the
    length-normalised sequence ratio under gspo): TRL's use_bias_correction_kl, which makes the estimate unbiased for
    tokens sampled from pi_old; on-policy the ratio is 1 but its gradient adds KL x grad log pi. false: the plain
    estimator, as DeepSeekMath's GRPO."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus entropy_coef x the mean entropy of the step's trained tokens (the same meaning
    under every aggregation, as TRL's entropy_coef); 0: off."""
    top_entropy_quantile: float = 1.0
    """Train the policy term only on the step's highest-entropy tokens, this share of them (Beyond the 80/20 rule,
    arXiv 2506.01939: 0.2); the threshold is taken over the whole step's trained tokens, as the paper does, at the
    cost of one no-gradient forward pass; the KL term stays on every token. 1: off."""
    count_untrained_rows: bool = False
    """Count the rows with no trained token (cut under mask_truncated, or left unscored) in the per-sequence
    normalisers (sequence_mean, token_sum_constant, sequence_sum), as TRL 1.16 does; false: only rows with a trained
    token count, so a row the reward could not judge does not shrink the step (rlvr's choice)."""
    aggregation: Aggregation = "sequence_mean"
    """Loss aggregation: sequence_mean (GRPO), token_mean (DAPO), token_sum_constant (Dr. GRPO), sequence_sum
    (LUSPO: each sequence's token sum, averaged over sequences)."""
    ratio_to: RatioTo = "proximal"
    """Denominator of the ratio: proximal (the weights as the step began; AReaL's decoupled PPO) or behaviour (the
    policy that sampled the tokens, as TRL's async trainer and prime-rl do)."""
    is_level: ISLevel = "token"
    """Importance weight pi_prox / pi_behav on the policy term, per token, per sequence, or none (only with
    ratio_to=proximal). On-policy it is 1 up to numerics; for stale or foreign samples it is the correction."""
    is_mode: ISMode = "truncate"
    """Weights above is_cap are truncated to it (TIS, verl's rollout_is) or masked to 0 (AReaL)."""
    is_cap: float = 2.0
    """Cap C >= 1 of the importance weight."""
    gap_mask: float = 0.0
    """Drop tokens whose probability moved more than this from the behaviour policy in the direction of their
    advantage (DPPO's binary-TV trust region, as in prime-rl); 0 disables."""

    def __post_init__(self) -> None:
        for name, allowed in (("objective", OBJECTIVE_NAMES), ("aggregation", AGGREGATIONS),
                              ("kl_estimator", KL_ESTIMATORS), ("ratio_to", RATIO_TO), ("is_level", IS_LEVELS),
                              ("is_mode", IS_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.ratio_to == "behaviour" and self.is_level != "none":
            raise ValueError(
                "ratio_to='behaviour' already divides by the behaviour policy; an importance weight on top would "
                "correct twice: set is_level='none', or ratio_to='proximal' for the decoupled objective"
            )
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or 0 to disable); got {self.dual_clip}")
        if not (self.eps_low >= 0 and self.eps_high >= 0):
            raise ValueError(f"eps_low and eps_high must be >= 0; got {self.eps_low} and {self.eps_high}")
        if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ValueError(f"sapo_tau_pos and sapo_tau_neg must be > 0; got {self.sapo_tau_pos}, {self.sapo_tau_neg}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0 (a bonus; 0: off); got {self.entropy_coef}")
        if not 0 < self.top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile must be in (0, 1] (the share of tokens trained; 1: all); got "
                             f"{self.top_entropy_quantile}")
        if self.is_cap < 1:
            raise ValueError(f"is_cap must be >= 1; got {self.is_cap}")
        if not 0 <= self.gap_mask < 1:
            raise ValueError(f"gap_mask is a probability gap in [0, 1); got {self.gap_mask}")
