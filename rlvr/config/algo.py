"""The run config's ``algo`` section: which algorithm, its preset, the loss knobs (``rlvr.core.LossSettings``,
documented and checked there) and the advantage and reference knobs; and the presets.

A preset is a named setting of the same knobs (the training loop never branches on it); each lists only what
differs from the defaults (scale group, objective ppo_clip, aggregation sequence_mean, eps_low = eps_high = 0.2,
beta 0, no dynamic sampling), and every one states beta, since the default run's (grpo's) 0.04 is not the field's 0.
- grpo: DeepSeekMath GRPO: group-std advantages, sequence-mean aggregation, symmetric clip 0.2, k3 KL, beta 0.04.
- dapo: DAPO: token-mean aggregation, clip-higher (0.2 / 0.28), no KL, dynamic sampling (zero-variance groups
  dropped and replaced). Its overlong shaping is a reward (overlong_penalty), not a loss knob.
- dr_grpo: Dr. GRPO: no std scaling, token sum over a constant (max_new_tokens x sequences), no KL.
- gspo: GSPO: the sequence-level ratio, clip 3e-4 / 4e-4 (the paper's section 5.1), sequence mean, no KL.
- luspo: LUSPO: GSPO's objective with each sequence's loss summed (sequence_sum), clip 2e-3 / 2.5e-3, no KL.
- cispo: CISPO: the clipped, detached ratio on REINFORCE, no lower bound, cap 5 (eps_high 4), token mean, no KL.
- sapo: SAPO: the soft gate (temperatures 1.0 / 1.05), sequence mean, no KL.
- ppo: PPO with a critic (algo.name=ppo): advantages from GAE, the KL penalty in the reward (ppo.kl_coef).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from rlvr.config.checks import at_least, check_choices
from rlvr.core.advantages import SCALES, check_negative_scale
from rlvr.core.settings import LossSettings

PRESETS: dict[str, dict[str, object]] = {
    "grpo": {"beta": 0.04},
    "dapo": {"aggregation": "token_mean", "eps_high": 0.28, "beta": 0.0, "dynamic_sampling": True},
    "dr_grpo": {"scale": "none", "aggregation": "token_sum_constant", "beta": 0.0},
    "gspo": {"objective": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "beta": 0.0},
    "luspo": {"objective": "gspo", "aggregation": "sequence_sum", "eps_low": 2e-3, "eps_high": 2.5e-3, "beta": 0.0},
    "cispo": {"objective": "cispo", "aggregation": "token_mean", "eps_low": 1.0, "eps_high": 4.0, "beta": 0.0},
    "sapo": {"objective": "sapo", "beta": 0.0},
    "ppo": {"scale": "none", "aggregation": "token_mean", "beta": 0.0},
}
ALGORITHMS = ("grpo", "ppo")
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass(frozen=True)
class _AlgoHead:
    """The algo keys listed before the loss knobs (a base class: a dataclass lists its bases' fields first)."""

    name: Literal[ALGORITHMS] = "grpo"
    """grpo: group-relative advantages, no value model (its variants are presets); ppo: a critic initialised from
    the policy, GAE advantages (the baseline that shows what GRPO saves; settings in the ppo section)."""
    preset: Literal[tuple(PRESETS)] = "grpo"
    """grpo, dapo, dr_grpo, gspo, luspo, cispo, sapo (with algo.name=grpo) or ppo (the default with algo.name=ppo):
    fills every knob below that is not set explicitly (docs/concepts/objectives.md)."""
    scale: Literal[SCALES] = "group"
    """Advantage scaling: group (GRPO), batch, none (Dr. GRPO)."""
    reward_aggregation: Literal[REWARD_AGGREGATIONS] = "sum_then_normalize"
    """With several reward functions: sum_then_normalize (their weighted sum, then the advantage scaling above) or
    normalize_then_sum (GDPO, arXiv 2601.05242: each function normalised within its group, weighted and summed, then
    normalised over the batch; algo.scale is not used; TRL's multi_objective_aggregation)."""


@dataclass(frozen=True)
class AlgoConfig(LossSettings, _AlgoHead):
    """The objective: the loss knobs of ``rlvr.core.LossSettings`` (documented and checked there) and these."""

    num_iterations: int = 1
    """mu: optimizer passes over each batch of groups (1: no proximal-policy forward is needed)."""
    adv_eps: float = 1e-4
    """Added to the std when scaling advantages."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: completions cut at rollout.max_new_tokens are not trained on (they still count
    in their group's mean and std), so a ramble that ran out of tokens is neither pushed up nor down."""
    negative_scale: float = 1.0
    """Multiplier on negative advantages, in [0, 1]: 1 is GRPO; 0 reinforces only completions better than their
    group's mean. Damping it keeps a weak model on its format when nearly every sample is wrong (measured:
    docs/experiments/word_problems.md)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no signal) and sample more prompts until the step has
    train.prompts_per_step informative groups, or max_resample_rounds extra rounds were spent; then the step trains
    the informative groups it has (none: the first prompts_per_step groups sampled, as they are). Synchronous and
    asynchronous runs alike (rlvr/run/dynamic_sampling.py)."""
    max_resample_rounds: int = 3
    """Extra rounds a step's dynamic sampling may spend, each up to train.prompts_per_step prompts: a step samples
    at most (1 + max_resample_rounds) x prompts_per_step groups (asynchronous runs: groups taken from the servers,
    stale ones not counted)."""
    ref_sync_steps: int = 0
    """Every this many optimizer steps the KL reference moves towards the policy: theta_ref <- (1 - ref_mixup_alpha)
    theta_ref + ref_mixup_alpha theta (TR-DPO, arXiv 2404.09656; TRL's sync_ref_model). Under LoRA the reference is
    an earlier adapter, mixed elementwise (models.policy.ReferencePolicy). 0: the reference stays the starting model.
    Needs beta != 0."""
    ref_mixup_alpha: float = 0.6
    """ref_sync_steps: the share of the policy mixed into the reference at each refresh (1: a copy)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choices(self)
        at_least(self, 1, "num_iterations")
        at_least(self, 0, "adv_eps", "max_resample_rounds", "ref_sync_steps")
        check_negative_scale(self.negative_scale)
        if not 0 < self.ref_mixup_alpha <= 1:
            raise ValueError(f"ref_mixup_alpha must be in (0, 1]; got {self.ref_mixup_alpha}")
        if self.ref_sync_steps and self.name == "ppo":
            raise ValueError("ref_sync_steps refreshes GRPO's KL reference; PPO's KL is in its reward (ppo.kl_coef): "
                             "set ref_sync_steps=0")
        if self.ref_sync_steps and self.beta == 0:
            raise ValueError(f"ref_sync_steps={self.ref_sync_steps} refreshes the KL reference, but beta is 0 (no "
                             "reference is used): set beta > 0, or ref_sync_steps=0")

    def loss_settings(self) -> LossSettings:
        """The loss knobs alone, as a plain ``LossSettings``."""
        return LossSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LossSettings)})
