"""``rlvr train`` as a function: pick the batch source and the update a configuration asks for, open the run
(or resume it) and run the one loop (rlvr/run/loop.py).

    source = synchronous (rlvr/run/collect.py) | asynchronous (rlvr/runtime/source.py, async.enabled)
    update = GRPO (rlvr/learn/step.py)           | PPO with a critic (rlvr/learn/ppo.py, algo.name=ppo)
             | GRPO with a teacher's per-token advantage (rlvr/learn/distill.py, distill.*)
             wrapped by a DiLoCo round every H steps (rlvr/run/diloco.py, diloco.learner)
    source, with diloco.rollouts: the learners' scored groups shared too (rlvr/run/shared_rollouts.py)
"""

from __future__ import annotations

from rlvr.config.schema import RunConfig
from rlvr.learn.distill import DistillUpdate
from rlvr.learn.ppo import PPOUpdate
from rlvr.learn.step import GRPOUpdate
from rlvr.rewards import WeightedReward
from rlvr.run.collect import SyncSource, group_advantage_fn
from rlvr.run.diloco import DilocoUpdate
from rlvr.run.lifecycle import NonFiniteError, fresh_run_dir, open_run
from rlvr.run.loop import run_loop
from rlvr.run.scoring import EnvironmentObjects
from rlvr.run.shared_rollouts import SharingSource
from rlvr.runtime.source import AsyncSource

__all__ = ["NonFiniteError", "fresh_run_dir", "train"]


def train(cfg: RunConfig, rewards: list[WeightedReward] | None = None,
          environment: EnvironmentObjects | None = None) -> dict:
    """Train as configured; returns the summary also written to ``summary.json``. ``rewards``: reward functions
    built already (Python callables: rlvr.api), used instead of cfg.rewards; ``environment``: an episode
    environment's factory and tools as objects, used instead of env.factory / env.tools."""
    if cfg.diloco.placement == "ray":  # K learners as Ray tasks, each this function with diloco.learner=k/K
        from rlvr.runtime.ray_learners import train_on_ray

        return train_on_ray(cfg, train)
    algo = cfg.algo
    if algo.name == "ppo":  # advantages come from the critic, inside the update
        update, advantages = PPOUpdate(cfg), None
    else:
        update = DistillUpdate(cfg) if cfg.distill.enabled else GRPOUpdate(cfg)
        advantages = group_advantage_fn(cfg.rollout.group_size, algo.scale, algo.adv_eps, algo.negative_scale,
                                        algo.reward_aggregation)
    diloco = DilocoUpdate(update, cfg) if cfg.diloco.learner else None  # a round every diloco.inner_steps steps
    update = diloco or update
    source = AsyncSource(cfg, advantages) if cfg.asynchronous.enabled else SyncSource(cfg, advantages)
    if diloco is not None and cfg.diloco.rollouts != "off":  # the learners' scored groups through the bucket too
        source = SharingSource(source, cfg, round_of=lambda: diloco.round)  # its groups carry the round
    run = open_run(cfg, update, rewards, environment)
    if diloco is not None:
        diloco.bind(run)
    if isinstance(update, DistillUpdate):  # distill.hint: the teacher's prompts come from the rows
        update.bind(run.data.train_rows, run.data.tokenizer)
    return run_loop(run, source, update)
