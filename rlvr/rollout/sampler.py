"""The Sampler protocol: prompts + sampling parameters + seed -> Groups tagged with a policy version.

The training loop only talks to a Sampler, so generation may run in this process (``LocalSampler``) or on
rollout servers over HTTP; ``sync`` is how the trainer hands its updated weights to the sampler.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from rlvr.models import autocast
from rlvr.prompts import Prompt
from rlvr.rollout.engine import SamplingParams
from rlvr.rollout.groups import Groups, sample_groups


class StaleVersion(RuntimeError):
    """The policy version a sample was asked of is gone from the sampler (replaced by newer ones while the
    request was in flight, e.g. on a server that restarted meanwhile): sample the prompt again."""


class Sampler(Protocol):
    version: int
    """Policy version new samples are drawn from (0: the initial weights; v: after v updates)."""

    def sample(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int) -> Groups:
        """``group_size`` completions per prompt, reproducible for a given seed where the backend allows."""
        ...

    def sync(self, version: int) -> None:
        """Make the trainer's current weights the sampling policy, as ``version``."""
        ...

    def stats(self) -> dict[str, float]:
        """Numbers worth logging (requests, retries, adapter sync latency and bytes); may be empty."""
        ...

    def close(self) -> None:
        """Release connections and threads."""
        ...


class LocalSampler:
    """Samples from the training model itself, in this process (it shares the weights, so ``sync`` only
    records the version)."""

    def __init__(self, model: nn.Module, tokenizer, autocast_mode: str = "none", version: int = 0):
        self.model, self.tokenizer, self.autocast_mode, self.version = model, tokenizer, autocast_mode, version

    def sample(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int) -> Groups:
        generator = torch.Generator().manual_seed(seed)
        with autocast(self.model, self.autocast_mode):
            return sample_groups(self.model, self.tokenizer, prompts, group_size, params, generator, self.version)

    def sync(self, version: int) -> None:
        self.version = version

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
