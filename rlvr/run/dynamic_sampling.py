"""DAPO's dynamic sampling, decided here for every batch source: which groups sampled for a step are trained, and
when the step stops sampling.

A step trains B groups (train.prompts_per_step). Without dynamic sampling those are the first B sampled. With
it, a group whose rewards are all equal (no signal) is dropped and more are sampled, until B informative groups
are in hand or (1 + algo.max_resample_rounds) x B groups were sampled: the first round and the extra rounds, B
prompts each. Informative groups beyond B are dropped (DAPO). When the budget is spent the step trains the
informative groups it has, or, if it has none, the first B groups sampled as they are (advantages all 0, as in GRPO
without dynamic sampling).

The synchronous source (collect.py) offers whole rounds of B groups; the asynchronous one
(rlvr/runtime/orchestrator.py) offers groups one at a time as the servers return them (a group too stale to train
is sampled again, not offered). Both offer them in the order they were sampled.
"""

from __future__ import annotations

from typing import Generic, TypeVar

G = TypeVar("G")  # whatever identifies a group to the source


class DynamicSampling(Generic[G]):
    """The groups of one step: offer each group sampled, in order, until ``done``; then train ``trained()``."""

    def __init__(self, prompts: int, enabled: bool, max_resample_rounds: int):
        self.prompts, self.enabled = prompts, enabled
        self.budget = prompts * (1 + max_resample_rounds) if enabled else prompts  # groups sampled, at most
        self.sampled = 0
        self.kept: list[G] = []
        self.first: list[G] = []  # the first B sampled: trained as they are when none is informative

    def offer(self, group: G, informative: bool) -> bool:
        """Count ``group`` as sampled for this step; whether it is kept for training."""
        self.sampled += 1
        if len(self.first) < self.prompts:
            self.first.append(group)
        keep = len(self.kept) < self.prompts and (informative or not self.enabled)
        if keep:
            self.kept.append(group)
        return keep

    @property
    def done(self) -> bool:
        """B groups are kept, or the step's budget of sampled groups is spent: sample no more."""
        return len(self.kept) == self.prompts or self.sampled >= self.budget

    def trained(self) -> list[G]:
        """The groups the step trains, in the order sampled: those kept, or none kept: the first B sampled."""
        return self.kept or self.first
