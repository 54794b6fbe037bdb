"""What a batch source hands the loop for one step: the groups to train, with their rewards and advantages
(``Collected``), and every sampling round drawn for it (``Round``: groups sampled for some prompts, scored; the
synchronous source samples B prompts a round, the asynchronous orchestrator one). Every batch source and update
reads these."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlvr.core import informative_groups
from rlvr.rewards import Scores
from rlvr.rollout.episodes import EpisodeStats
from rlvr.rollout.groups import Groups


@dataclass
class Round:
    """One sampling round: B prompts (dataset rows ``row_ids``), G completions or episodes each, scored."""

    row_ids: list[int]  # [B] dataset row of each group
    groups: Groups  # B groups of G completions (or episodes)
    scores: Scores  # [B*G]
    episode_stats: EpisodeStats | None = None  # turns, tool calls, truncations (None: single completions)
    time_generate_s: float = 0.0  # sampling (episodes: tool calls included; asynchronous: on a server, overlapped)
    time_reward_s: float = 0.0  # the reward functions
    uids: list[int] | None = None  # [B] positions in the data stream (asynchronous source only: prompt identities)

    @property
    def informative(self) -> torch.Tensor:
        """[B] bool: the group's rewards differ (rlvr.core.informative_groups)."""
        return informative_groups(self.scores.total, self.groups.group_size)

    @property
    def versions(self) -> torch.Tensor:
        """[B] long: the policy version that sampled each group (its first completion's)."""
        return self.groups.version.view(-1, self.groups.group_size)[:, 0]

    @staticmethod
    def concat(parts: list[Round]) -> Round:
        """One round of the groups of ``parts``, in order; times summed (uids: None unless every part has them)."""
        return Round(
            [i for p in parts for i in p.row_ids],
            Groups.concat([p.groups for p in parts]),
            Scores.concat([p.scores for p in parts]),
            EpisodeStats.total([p.episode_stats for p in parts]),
            sum(p.time_generate_s for p in parts),
            sum(p.time_reward_s for p in parts),
            [u for p in parts for u in p.uids] if all(p.uids is not None for p in parts) else None,
        )


@dataclass
class Collected:
    """What one step trains on (``groups`` and everything aligned with them) and every round sampled for it."""

    rounds: list[Round]
    row_ids: list[int]  # dataset row of each trained group
    groups: Groups
    scores: Scores  # per trained completion
    adv: torch.Tensor | None  # [N]; None when the update computes its own (PPO: GAE from the critic)
    time_generate_s: float  # sampling time of the trained groups (asynchronous: on the servers, overlapped)
    time_reward_s: float

    @property
    def included(self) -> torch.Tensor:
        """[N] bool: completions with a reward (the others are not trained on)."""
        return ~torch.isnan(self.scores.total)
