"""What an update takes: the ``Learner`` (the policy, its optimizer and schedule, the frozen reference) and its
``team``, the other learners of a torchrun job. The step calls the team at four points and reads as a one-process
step: which groups are this learner's, the micro-batches FSDP's collectives need, the gradients' sum, and the
loss's and statistics' sums. ``Alone`` does nothing at each; ``Torchrun`` sums over the learners
(docs/concepts/distributed.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from rlvr.learn.batch import StepBatch
from rlvr.learn.sharding import clip_sharded_gradients
from rlvr.models.policy import ReferencePolicy
from rlvr.platform.distributed import Collectives


class Alone:
    """One learner: every group is its own, nothing is sent."""

    sharded = False

    def groups(self, num_groups: int) -> range | None:
        """This learner's groups of the step (None: all of them)."""
        return None

    def fillers(self, batch: StepBatch, mine: int) -> list[torch.Tensor]:
        """Micro-batches to run besides this learner's ``mine`` (their loss multiplied by 0)."""
        return []

    def sum_gradients(self, params: list[nn.Parameter], micro_batches: int) -> None:
        """Make ``params``' gradients the whole step's (``micro_batches``: how many ran here, fillers included)."""

    def sum_loss(self, loss: float) -> float:
        return loss

    def clip_gradients(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Clip the gradients' total norm to ``max_norm``; returns the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def sum_statistics(self, sums: dict[str, float]) -> dict[str, float]:
        """The step's statistic sums over every learner's rows (``*_max``: the largest)."""
        return sums

    def report(self) -> dict[str, float]:
        """What the team sent during the step, for the update's metrics."""
        return {}


class Torchrun(Alone):
    """One of several learners: the batch is the whole step's on every rank; this one trains its share of the
    groups, and the gradients, loss and statistics are summed over the ranks, so every rank steps as one process on
    the whole batch would. With sharded weights (FSDP2: rlvr.learn.sharding) the gradient sums are FSDP's
    reduce-scatters inside the model's calls, so every rank runs as many micro-batches as the busiest one."""

    def __init__(self, collectives: Collectives, sharded: bool):
        self.collectives, self.sharded, self.sent = collectives, sharded, 0

    def groups(self, num_groups: int) -> range:
        return self.collectives.world.share(num_groups)

    def fillers(self, batch: StepBatch, mine: int) -> list[torch.Tensor]:
        """Sharded weights: micro-batches that bring this learner's count up to the job's largest (one row that has
        trained tokens, repeated)."""
        if not self.sharded:
            return []
        missing = int(self.collectives.max_float(float(mine))) - mine
        trained = torch.nonzero(batch.loss_mask.sum(-1) > 0)[:1, 0]  # [1] (or [0]: nothing trains anywhere)
        return [trained] * missing if len(trained) else []

    def sum_gradients(self, params: list[nn.Parameter], micro_batches: int) -> None:
        if self.sharded:  # FSDP reduce-scattered each micro-batch's gradients
            self.sent += micro_batches * sum(p.numel() * p.element_size() for p in params)
        else:  # one all-reduce of the gradients
            self.sent += self.collectives.sum_gradients(params)

    def sum_loss(self, loss: float) -> float:
        return self.collectives.sum_floats({"loss": loss})["loss"]

    def clip_gradients(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Sharded gradients: the norm is summed over the learners' shards."""
        if self.sharded:
            return clip_sharded_gradients(params, max_norm)
        return super().clip_gradients(params, max_norm)

    def sum_statistics(self, sums: dict[str, float]) -> dict[str, float]:
        """A learner without rows has no statistics: the names are gathered first, so every rank reduces the same."""
        names = sorted({n for names in self.collectives.gather_texts(sorted(sums)) for n in names})
        maxima = {n: self.collectives.max_float(sums.get(n, -math.inf)) for n in names if n.endswith("_max")}
        total = self.collectives.sum_floats({n: sums.get(n, 0.0) for n in names if n not in maxima})
        return {**total, **maxima}

    def report(self) -> dict[str, float]:
        sent, self.sent = self.sent, 0
        return {"allreduce_bytes": sent}


def team_of(collectives: Collectives, sharded: bool) -> Alone:
    """The team for this process: ``Alone`` unless the job has several learners."""
    return Torchrun(collectives, sharded) if collectives.world.size > 1 else Alone()


@dataclass
class Learner:
    """What an update changes (the policy through its optimizer and schedule) and reads (the reference)."""

    model: nn.Module  # the policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    reference: ReferencePolicy | None = None
    team: Alone = field(default_factory=Alone)

    def trained_parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps. Sharded: read from the optimizer, since the root group may be gathered (other
        objects) right now; otherwise the model's parameters that take a gradient."""
        if self.team.sharded:
            return [p for g in self.optimizer.param_groups for p in g["params"]]
        return [p for p in self.model.parameters() if p.requires_grad]
