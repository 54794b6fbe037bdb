"""Rollouts: sample G completions per prompt and record what the trainer needs."""

from rlvr.models.prompts import Prompt, encode_prompts
from rlvr.rollout.engine import SampledTokens, SamplingParams, generate_groups
from rlvr.rollout.groups import Groups, sample_groups
from rlvr.rollout.sampler import LocalSampler, Sampler, StaleVersion

__all__ = [
    "Groups",
    "LocalSampler",
    "Prompt",
    "SampledTokens",
    "Sampler",
    "SamplingParams",
    "StaleVersion",
    "encode_prompts",
    "generate_groups",
    "sample_groups",
]
