"""The algorithm core: pure torch functions with documented shapes; no I/O, no configs, no models."""

from rlvr.core.advantages import group_advantages, informative_groups, zero_variance_fraction
from rlvr.core.fused import fused_head_loss
from rlvr.core.logprobs import token_logprobs
from rlvr.core.losses import (
    LossSettings,
    TokenInputs,
    aggregate,
    clipped_surrogate,
    kl_penalty,
    loss_normaliser,
    merge_stat_sums,
    policy_loss,
    stat_sums,
    token_objective,
    token_weights,
)
from rlvr.core.off_policy import gap_mask, importance_weight, sequence_log_ratio
from rlvr.core.ppo import PPOSettings

__all__ = [
    "LossSettings",
    "PPOSettings",
    "TokenInputs",
    "aggregate",
    "clipped_surrogate",
    "fused_head_loss",
    "gap_mask",
    "group_advantages",
    "importance_weight",
    "informative_groups",
    "kl_penalty",
    "loss_normaliser",
    "merge_stat_sums",
    "policy_loss",
    "sequence_log_ratio",
    "stat_sums",
    "token_logprobs",
    "token_objective",
    "token_weights",
    "zero_variance_fraction",
]
