"""What a batch source hands the loop for one step: the groups to train, with their rewards and advantages
(``Collected``), and every sampling round drawn for it (``Round``). Every batch source and update reads these."""

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

    row_ids: list[int]
    groups: Groups
    scores: Scores
    episode_stats: EpisodeStats | None = None  # turns, tool calls, truncations (None: single completions)
    time_generate_s: float = 0.0  # sampling (episodes: tool calls included)
    time_reward_s: float = 0.0  # the reward functions
    uids: list[int] | None = None  # positions in the data stream (asynchronous runs log them)

    @property
    def informative(self) -> torch.Tensor:
        """[B] bool: the group's rewards differ (rlvr.core.informative_groups)."""
        return informative_groups(self.scores.total, self.groups.group_size)


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
