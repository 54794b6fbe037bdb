"""The synchronous GRPO loop, top to bottom:

    collect (prompts -> G completions each -> rewards -> advantages) -> update -> sync the sampler -> log
    -> evaluate -> checkpoint -> save

Every source of randomness in a step is a pure function of (seed, step) and the data cursor - which rows,
which tokens - or is restored from the checkpoint, so a resumed run repeats the uninterrupted one bit for bit
(CPU, fp32).
"""

from __future__ import annotations

import contextlib

from tqdm.auto import tqdm

from rlvr.config import RunConfig
from rlvr.faults import fault_point
from rlvr.tasks import data_order
from rlvr.train.build import build_sampler, sampling_params
from rlvr.train.collect import collect
from rlvr.train.run import NonFiniteError, fresh_run_dir, open_run, stop_on_interrupt

__all__ = ["NonFiniteError", "fresh_run_dir", "train"]


def train(cfg: RunConfig) -> dict:
    """Train as configured; returns the summary also written to ``summary.json``."""
    if cfg.asynchronous.enabled:
        from rlvr.runtime.learner import train_async

        return train_async(cfg)
    run = open_run(cfg)
    algo, B = cfg.algo, cfg.train.prompts_per_step

    def next_row_ids() -> list[int]:
        ids = data_order(len(run.data.train_rows), cfg.train.seed, run.state["cursor"], B)
        run.state["cursor"] += B
        return ids

    sampler = build_sampler(cfg, run.model, run.data.tokenizer, run.run_dir)
    with contextlib.closing(sampler), stop_on_interrupt() as stop, run.writer:
        run.sampler = sampler
        sampler.sync(run.start)  # version = optimizer steps taken; a remote sampler gets the restored weights here
        run.evaluate_before()
        bar = tqdm(range(run.start + 1, cfg.train.steps + 1), disable=not cfg.log.progress, desc=algo.preset,
                   unit="step", initial=run.start, total=cfg.train.steps)
        for step in bar:
            c = collect(sampler, next_row_ids, run.data.train_rows, cfg.rollout.group_size,
                        sampling_params(cfg.rollout), run.rewards, seed=cfg.train.seed * 1_000_003 + step,
                        scale=algo.scale, adv_eps=algo.adv_eps, negative_scale=algo.negative_scale,
                        dynamic_sampling=algo.dynamic_sampling,
                        max_extra_rounds=algo.max_resample_rounds)
            fault_point("after_generate", step)
            metrics = run.update(c, step)
            run.after_step(step, metrics, c)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{run.state['eval_accuracy']:.3f}")
            if stop.requested:
                bar.close()
                run.interrupted(step)
    return run.finish()
