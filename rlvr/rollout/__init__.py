"""Rollouts: sample G completions per prompt and record what the trainer needs."""

from rlvr.rollout.engine import Completions, SamplingParams, generate_groups
from rlvr.rollout.groups import Groups, Prompt, encode_prompts, sample_groups

__all__ = ["Completions", "Groups", "Prompt", "SamplingParams", "encode_prompts", "generate_groups", "sample_groups"]
