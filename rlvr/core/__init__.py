"""The algorithm core: pure torch functions with documented shapes; no I/O, no configs, no models."""

from rlvr.core.advantages import group_advantages, informative_groups, normalize_then_sum, zero_variance_fraction
from rlvr.core.fused import fused_logprobs
from rlvr.core.logprobs import token_logprobs
from rlvr.core.losses import (
    aggregate,
    kl_penalty,
    loss_normaliser,
    merge_stat_sums,
    policy_loss,
    stat_sums,
    token_loss,
    token_weights,
)
from rlvr.core.objectives import OBJECTIVES, TokenBatch, clipped_surrogate
from rlvr.core.off_policy import gap_mask, importance_weight, sequence_log_ratio
from rlvr.core.ppo import PPOSettings
from rlvr.core.settings import LossSettings

__all__ = [
    "OBJECTIVES",
    "LossSettings",
    "PPOSettings",
    "TokenBatch",
    "aggregate",
    "clipped_surrogate",
    "fused_logprobs",
    "gap_mask",
    "group_advantages",
    "importance_weight",
    "informative_groups",
    "kl_penalty",
    "loss_normaliser",
    "merge_stat_sums",
    "normalize_then_sum",
    "policy_loss",
    "sequence_log_ratio",
    "stat_sums",
    "token_logprobs",
    "token_loss",
    "token_weights",
    "zero_variance_fraction",
]
