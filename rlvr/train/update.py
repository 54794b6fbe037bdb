"""GRPO's update: the clipped policy loss on the advantages the batch source computed (``train_step``).

Every GRPO variant (grpo, dapo, dr_grpo presets) is this one update with other ``LossSettings``; PPO's update,
with a critic, is in rlvr/baselines/ppo.py.
"""

from __future__ import annotations

from torch import nn

from rlvr.config import RunConfig
from rlvr.models import autocast, trainable_parameters
from rlvr.train.batch import StepBatch
from rlvr.train.collect import Collected
from rlvr.train.run import Run
from rlvr.train.step import train_step


def step_batch(batch: Collected, adv, mask_truncated: bool) -> StepBatch:
    """The update's tensors for a scored batch; completions without a reward are kept but not trained on."""
    return StepBatch.from_groups(batch.groups, adv, batch.included, mask_truncated=mask_truncated)


def step_options(cfg: RunConfig) -> dict:
    """The step's keyword arguments every update shares. ``max_new_tokens`` is the longest a completion can be
    (Dr. GRPO's constant normaliser): an episode's whole budget when the run has episodes."""
    longest = cfg.env.max_episode_tokens if cfg.env.enabled else cfg.rollout.max_new_tokens
    return {"micro_batch_size": cfg.train.micro_batch_size, "max_new_tokens": longest,
            "max_grad_norm": cfg.train.max_grad_norm, "chunk_tokens": cfg.train.logprob_chunk}


class GRPOUpdate:
    def __init__(self, cfg: RunConfig):
        self.settings = cfg.algo.loss_settings()
        self.needs_reference = self.settings.beta != 0.0

    def attach(self, model: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        return model, trainable_parameters(model)

    def __call__(self, run: Run, batch: Collected) -> dict[str, float]:
        cfg = run.cfg
        if batch.adv is None:
            raise ValueError("GRPO trains on the batch source's advantages; this source computed none")
        with autocast(run.model, cfg.model.autocast):
            return train_step(run.model, run.optimizer, run.scheduler,
                              step_batch(batch, batch.adv, cfg.algo.mask_truncated), self.settings,
                              reference=run.reference, num_iterations=cfg.algo.num_iterations, **step_options(cfg))
