"""The Sampler protocol: prompts + sampling parameters + seed -> Groups tagged with a policy version.

The training loop only talks to a Sampler, so generation may run in this process (``LocalSampler``) or on
rollout servers over HTTP; ``sync`` is how the trainer hands its updated weights to the sampler.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from rlvr.models.policy import autocast
from rlvr.models.prompts import Prompt
from rlvr.platform.devices import model_device, sampling_generator
from rlvr.platform.seeds import episode_seed, request_seed
from rlvr.rollout.decode_weights import decode_dtype, decoding, fold_choice
from rlvr.rollout.engine import SamplingParams
from rlvr.rollout.episodes import Environment, EpisodeBatch, EpisodeLimits, local_turns, run_episodes
from rlvr.rollout.groups import Groups, eos_token_ids, sample_groups


class StaleVersion(RuntimeError):
    """The policy version a sample was asked of is gone from the sampler (replaced by newer ones while the
    request was in flight, e.g. on a server that restarted meanwhile): sample the prompt again."""


class Sampler(Protocol):
    version: int
    """Policy version new samples are drawn from (0: the initial weights; v: after v updates)."""

    def sample(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int,
               first: int = 0) -> Groups:
        """``group_size`` completions per prompt, reproducible for a given seed where the backend allows.
        ``first``: the position of ``prompts[0]`` in the step's batch (a learner's share of it, under torchrun),
        so that a prompt's completions are seeded by its place in the whole batch."""
        ...

    def sample_episodes(self, prompt_ids: list[list[int]], envs: list[Environment], group_size: int,
                        params: SamplingParams, seed: int, limits: EpisodeLimits, first: int = 0) -> EpisodeBatch:
        """``group_size`` multi-turn episodes per prompt (token ids; ``envs[i]`` is episode i's environment),
        driven by rlvr.rollout.episodes.run_episodes, every turn from the current version (``first``: as in
        ``sample``)."""
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
    records the version). Each generation decodes with the LoRA adapter folded into a copy of the weights, made
    when it starts, with the matmuls in ``precision`` (rlvr.rollout.decode_weights.decode_dtype: fp32, bf16, or
    auto, the default of ``rlvr train`` and ``rlvr serve`` too: bf16 for a model of 50M+ parameters where the
    hardware has bf16 units, else fp32). Episodes keep each episode's keys and values from turn to turn
    (rlvr.rollout.turn_cache; ``turn_cache=False``: every turn prefills its whole context, the reference)."""

    def __init__(self, model: nn.Module, tokenizer, autocast_mode: str = "none", version: int = 0,
                 precision: str = "auto", fold_lora: bool | str = "auto", per_completion_seeds: bool = False,
                 turn_cache: bool = True):
        self.model, self.tokenizer, self.autocast_mode, self.version = model, tokenizer, autocast_mode, version
        self.dtype = decode_dtype(precision, model)
        self.fold_lora = fold_lora  # rollout.fold_lora: decided per generation (auto: whether the copies fit)
        self.per_completion_seeds = per_completion_seeds
        self.turn_cache = turn_cache

    def sample(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int,
               first: int = 0) -> Groups:
        device = model_device(self.model)
        if self.per_completion_seeds:  # completion j of the batch: its own stream, whatever the batch's split
            generator = [sampling_generator(episode_seed(seed, first * group_size + j), device)
                         for j in range(len(prompts) * group_size)]
        else:
            generator = sampling_generator(request_seed(seed, first) if first else seed, device)
        with autocast(self.model, self.autocast_mode):
            return sample_groups(self.model, self.tokenizer, prompts, group_size, params, generator, self.version,
                                 self.dtype, self.fold_lora)

    def sample_episodes(self, prompt_ids: list[list[int]], envs: list[Environment], group_size: int,
                        params: SamplingParams, seed: int, limits: EpisodeLimits, first: int = 0) -> EpisodeBatch:
        n = len(prompt_ids) * group_size
        device = model_device(self.model)
        generators = [sampling_generator(episode_seed(seed, first * group_size + i), device) for i in range(n)]
        was_training = self.model.training
        self.model.eval()
        try:
            eos = eos_token_ids(self.model, self.tokenizer)
            fold = fold_choice(self.fold_lora, self.model, self.dtype, n,
                               max(map(len, prompt_ids), default=0) + limits.max_episode_tokens)
            with autocast(self.model, self.autocast_mode), decoding(self.model, self.dtype, fold=fold) as decoder:
                turns = local_turns(decoder, self.tokenizer, eos, params, generators, self.turn_cache)
                return run_episodes(turns, self.tokenizer, prompt_ids, envs, group_size, params, limits, eos,
                                    self.version)
        finally:
            self.model.train(was_training)

    def sync(self, version: int) -> None:
        self.version = version

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
