"""DiLoCo's settings (the ``diloco`` section): learners that share only a bucket. The exchange is
rlvr/store/rounds.py, the round rlvr/run/diloco.py, the outer step rlvr/core/outer.py; docs/concepts/diloco.md."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from rlvr.config.checks import at_least, check_choices

DELTA_DTYPES = ("fp32", "bf16")
DILOCO_PLACEMENTS = ("hand", "ray")
ROLLOUT_SHARING = ("off", "step", "recent")


@dataclass(frozen=True)
class DilocoConfig:
    learner: str = ""
    """k/K: this run is learner k (0-based) of K DiLoCo learners that share only diloco.bucket ('' : off). Each
    trains its own shard of the training rows (those whose index is k modulo K). docs/concepts/diloco.md."""
    bucket: str = ""
    """Where the learners exchange deltas: a directory every learner can reach (local or shared disk) or an fsspec
    URL (s3://, gs://, ...)."""
    inner_steps: int = 16
    """H: the steps each learner takes on its own between two exchanges (a round); 0: the weights never meet (only
    with diloco.rollouts, where the learners share their groups instead)."""
    outer_lr: float = 0.7
    """The outer optimizer's learning rate (Nesterov SGD on the mean delta; 1.0 with outer_momentum 0 averages).
    The paper's 0.7 / 0.9 suit H >= 16 here; at H = 4 and 1 they diverged (docs/concepts/diloco.md): average there."""
    outer_momentum: float = 0.9
    """The outer optimizer's Nesterov momentum."""
    round_timeout_s: float = 600.0
    """Seconds a learner waits after publishing its delta for the others'; then the round closes with the deltas
    that arrived (at least min_learners, else with none: every learner starts the next round from the same weights
    again). A delta that arrives after its round closed is dropped (counted)."""
    min_learners: int = 1
    """Deltas a round needs to take an outer step when it closes at the timeout."""
    max_delta_norm: float = 0.0
    """A learner's delta is scaled down to this L2 norm before averaging: one poisoned learner moves the average by
    at most max_delta_norm / K. 0: the bound is max_delta_ratio x the L2 norm of the round's start weights."""
    max_delta_ratio: float = 1.0
    """With max_delta_norm 0, a delta's bound relative to the weights it changes: max_delta_ratio x the L2 norm of
    the trainable parameters at the round's start (a LoRA adapter's A and B, or the whole model). An honest round
    moves them by a small share of that (docs/concepts/diloco.md); 0 (and max_delta_norm 0): no bound at all."""
    delta_dtype: Literal[DELTA_DTYPES] = "fp32"
    """The dtype deltas travel in: fp32, or bf16 (half the bytes; the delta's rounding, not the weights')."""
    join: bool = False
    """Let a fresh learner (no checkpoint of its own) join a job whose bucket already holds decided rounds; false: it
    stops with a line saying so (a second run of the same config would otherwise continue the first job's rounds
    and weights). A learner resumed with resume=auto always continues its job."""
    reset_optimizer: bool = False
    """Reset the inner AdamW state at each round boundary (false: kept, as DiLoCo's paper keeps it)."""
    placement: Literal[DILOCO_PLACEMENTS] = "hand"
    """hand: one rlvr train per learner (diloco.learner=k/K), started by you on each machine; ray: this rlvr train
    places diloco.learners learners as Ray tasks on the cluster at async.ray_address (each writes
    OUTPUT_DIR/learner-k; diloco.bucket must be reachable from every node)."""
    learners: int = 0
    """placement ray: how many learners to place."""
    rollouts: Literal[ROLLOUT_SHARING] = "off"
    """Share scored groups through the bucket as well (docs/concepts/shared_rollouts.md): each learner publishes its
    informative groups every step and trains on the peers' too, re-scoring each with its own reward functions (a
    peer's reward is never used) and correcting it by the importance weight of algo.is_mode / is_cap. step: every
    learner trains on every learner's groups of the step, in learner order, waiting for them (the learners draw
    one batch of K x train.prompts_per_step prompts together and sample their shares of it; from the same weights
    this is one learner at K times the batch, exchanging kilobytes instead of gradients); recent: its own groups
    and up to diloco.external_groups of the peers' newest (diloco.rollout_max_age, rollout_max_rounds), without
    ever waiting (SAPO-style; each learner on its own shard, at its own pace: docs/concepts/swarm.md). off: only
    weights meet."""
    external_groups: int = 0
    """rollouts=recent: at most this many peers' groups a step (0: as many as train.prompts_per_step)."""
    rollout_max_age: int = 2
    """rollouts=recent: of each peer's steps not yet taken, a step takes only those among the peer's newest
    rollout_max_age (counted in the peer's own steps: learners of unequal speed have their own step numbers);
    older ones are skipped for good."""
    rollout_max_rounds: int = 1
    """rollouts=recent with weight rounds (inner_steps >= 1): a peer's groups are taken only when the weights that
    sampled them are those of this learner's round or of at most this many rounds before it (a suspended or slow
    peer's older groups are skipped, counted as stale)."""
    rollout_timeout_s: float = 600.0
    """rollouts=step: seconds a step waits for the peers' groups of the step; then it trains on those that
    arrived, and a peer that missed a step is not waited for again until it publishes one."""

    def __post_init__(self) -> None:
        check_choices(self)
        at_least(self, 1, "min_learners")
        at_least(self, 0, "inner_steps", "max_delta_norm", "max_delta_ratio", "external_groups", "rollout_max_age",
                 "rollout_max_rounds")
        if not self.inner_steps and self.rollouts == "off":
            raise ValueError("diloco.inner_steps=0 never exchanges anything without diloco.rollouts: set "
                             "diloco.rollouts=step or recent, or inner_steps >= 1")
        if not self.rollout_timeout_s > 0:
            raise ValueError("diloco.rollout_timeout_s must be > 0")
        if not self.round_timeout_s > 0 or not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError("diloco needs round_timeout_s > 0, outer_lr > 0 and 0 <= outer_momentum < 1")
        if self.learner:
            parse_learner(self.learner)
        if self.placement == "ray" and (self.learner or self.learners < 1):
            raise ValueError("diloco.placement=ray places diloco.learners (>= 1) learners itself: set it, and leave "
                             "diloco.learner unset")


def parse_learner(spec: str) -> tuple[int, int]:
    """``"k/K"`` -> (k, K): learner k (0-based) of K."""
    match = re.fullmatch(r"([0-9]{1,6})/([0-9]{1,6})", spec.strip())
    if not match or not int(match[1]) < int(match[2]):
        raise ValueError(f"diloco.learner must be k/K with 0 <= k < K (learner 0 of 2 is 0/2); got {spec!r}")
    return int(match[1]), int(match[2])
