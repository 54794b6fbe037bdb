"""The algorithm core: pure torch functions with documented shapes; no I/O, no configs, no models."""

from rlvr.core.advantages import group_advantages, zero_variance_fraction
from rlvr.core.fused import fused_head_loss
from rlvr.core.logprobs import token_logprobs
from rlvr.core.losses import (
    LossSettings,
    aggregate,
    clipped_surrogate,
    kl_penalty,
    loss_normaliser,
    policy_loss,
    token_objective,
    token_weights,
)
from rlvr.core.presets import PRESETS

__all__ = [
    "PRESETS",
    "LossSettings",
    "aggregate",
    "clipped_surrogate",
    "fused_head_loss",
    "group_advantages",
    "kl_penalty",
    "loss_normaliser",
    "policy_loss",
    "token_logprobs",
    "token_objective",
    "token_weights",
    "zero_variance_fraction",
]
