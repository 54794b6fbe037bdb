"""The one training loop, for every runtime:

    batch = source.next(step)     sampled, scored, advantages computed (synchronous: collect.py; asynchronous:
                                  rlvr/runtime/source.py)
    update(run.learner, batch)    GRPO's update (step.py: GRPOUpdate -> train_step), or PPO's (rlvr/learn/ppo.py)
    sampler.sync(step)            the sampler now samples from the new weights (version = optimizer steps taken)
    log, evaluate, checkpoint     (run.py)

The entry point (rlvr/launch.py) picks the source and the update; this loop never branches on either. Every
source of randomness in a synchronous step is a pure function of (seed, step) and the data cursor, or is
restored from the checkpoint, so a resumed run repeats the uninterrupted one bit for bit (CPU, fp32).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from rlvr.models.architecture import unwrap
from rlvr.platform.devices import DeviceMemoryError, model_device, out_of_memory_advice
from rlvr.platform.faults import fault_point
from rlvr.rewards import base as reward_base
from rlvr.rewards.judge import judge_metrics
from rlvr.run.build import SAMPLER_BACKENDS
from rlvr.run.collect import collect_metrics, episode_metrics, warn_unscored
from rlvr.run.lifecycle import BatchSource, Run, Update, stop_on_interrupt
from rlvr.store.checkpoint import latest_valid
from rlvr.store.metrics import REWARD, namespaced


def run_loop(run: Run, source: BatchSource, update: Update) -> dict:
    """Train from ``run.start`` to train.steps; returns the summary also written to ``summary.json``."""
    cfg = run.cfg
    with contextlib.ExitStack() as stack, stop_on_interrupt() as stop, run.writer:
        run.stop = stop
        stack.callback(run.data.close)  # the tools' sandboxes, last
        run.sampler = source.open(run, stack)
        run.sampler.sync(run.start)  # version = optimizer steps taken; a remote sampler gets the restored weights
        run.evaluate_before()
        bar = tqdm(range(run.start + 1, cfg.train.steps + 1), disable=not (cfg.log.progress and run.main),
                   desc=f"{source.label}{cfg.algo.preset}", unit="step", initial=run.start, total=cfg.train.steps)
        warned = False  # about a batch without any reward: once per run, whichever source
        for step in bar:
            t0 = time.perf_counter()
            trainer_state(run, step)
            with out_of_memory(run, step):
                batch = source.next(run, step)
                warned = warn_unscored(batch, step, warned)
                fault_point("after_generate", step)
                t1 = time.perf_counter()
                stats = update(run.learner, batch)
            t2 = time.perf_counter()
            run.sampler.sync(step)
            fault_point("after_update", step)
            t3 = time.perf_counter()
            g = batch.groups
            tokens = float(g.completion_mask.sum() + g.prompt_mask.sum()) * cfg.algo.num_iterations  # trained on
            sections = {
                "rollout": collect_metrics(batch, step - 1),
                "update": {**stats, "time_s": t2 - t1, "tokens_per_s": tokens / max(t2 - t1, 1e-9)},
                "sampler": {"time_s": t3 - t2, **run.sampler.stats()},
            }
            episodes = episode_metrics(batch)
            if episodes:
                sections["episode"] = episodes
            judged = judge_metrics(run.rewards)
            if judged:
                sections["judge"] = judged  # calls, retries, failures, cache hits, tokens, latency
            logged = reward_base.CONTEXT.log.drain()
            if logged:
                sections["reward_log"] = logged  # what reward functions logged with TRL's log_metric
            report = source.report()
            if report:
                sections[source.metrics_section] = report  # async: the servers'; sync: the curriculum's
            metrics = namespaced(sections)
            run.after_step(step, metrics, batch, source.state(), started=t0)
            accuracy = run.state["eval_accuracy"]
            bar.set_postfix(reward=f"{metrics[REWARD]:.3f}", acc="-" if accuracy is None else f"{accuracy:.3f}")
            if run.collectives.any(stop.requested):  # under torchrun: every learner stops at the same step
                bar.close()
                run.interrupted(step, stop.signum)
        summary = run.finish()
    run.collectives.close()
    return summary


def trainer_state(run: Run, step: int) -> None:
    """TRL's trainer_state, as the reward functions of ``step`` see it: optimizer steps taken before it, the run's
    total, and the epochs of training rows drawn before it."""
    cfg, state = run.cfg, reward_base.CONTEXT.state
    state.global_step = (step - 1) * cfg.algo.num_iterations
    state.max_steps = cfg.train.steps * cfg.algo.num_iterations
    state.epoch = (step - 1) * cfg.train.prompts_per_step / max(len(run.data.train_rows), 1)


@contextlib.contextmanager
def out_of_memory(run: Run, step: int) -> Iterator[None]:
    """A device out-of-memory error in ``step`` becomes one line: the settings that lower the peak (with their values
    now) and the last checkpoint, untouched by the failed step, to resume from."""
    try:
        yield
    except torch.OutOfMemoryError:
        cfg = run.cfg
        knobs = {"train.micro_batch_size": cfg.train.micro_batch_size, "rollout.max_new_tokens":
                 cfg.rollout.max_new_tokens, "rollout.group_size": cfg.rollout.group_size}
        if cfg.model.lora and SAMPLER_BACKENDS[cfg.rollout.backend].in_process:
            knobs["rollout.fold_lora"] = cfg.rollout.fold_lora
        inner = unwrap(run.model)
        if not getattr(inner, "is_activation_checkpointing", getattr(inner, "is_gradient_checkpointing", True)):
            knobs["model.gradient_checkpointing"] = "off"
        last = latest_valid(run.run_dir / "checkpoints")
        saved = (f"The last checkpoint, {last}, is intact: lower one and continue with resume=auto." if last else
                 "No checkpoint was written yet: lower one and start again.")
        where = f"step {step}: "
        raise DeviceMemoryError(where + out_of_memory_advice(model_device(run.model), knobs, saved)) from None


__all__ = ["BatchSource", "Update", "out_of_memory", "run_loop"]
