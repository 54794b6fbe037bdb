"""The synchronous GRPO loop, top to bottom:

    collect (prompts -> G completions each -> rewards -> advantages) -> update -> sync the sampler -> log
    -> evaluate -> checkpoint -> save

Every source of randomness in a step is a pure function of (seed, step) - which rows, which tokens - or
is restored from the checkpoint, so a resumed run repeats the uninterrupted one bit for bit (CPU, fp32).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from rlvr.checkpoint import latest_valid, load_training_state, save_training_state
from rlvr.config import RunConfig, config_changes, save_config, to_yaml
from rlvr.core import LossSettings
from rlvr.faults import fault_point
from rlvr.memory import return_freed_memory
from rlvr.metrics import MetricsWriter, plot_run
from rlvr.models import ReferencePolicy, autocast, save_policy
from rlvr.rollout import Sampler
from rlvr.tasks import data_order
from rlvr.train.batch import StepBatch
from rlvr.train.build import (
    TaskData,
    build_optimizer,
    build_policy,
    build_rewards,
    build_sampler,
    build_scheduler,
    load_data,
    retune_optimizer,
    sampling_params,
)
from rlvr.train.collect import Collected, collect, collect_metrics
from rlvr.train.evaluate import evaluate
from rlvr.train.step import train_step


class NonFiniteError(RuntimeError):
    pass


class stop_on_interrupt:
    """The first Ctrl-C asks the loop to stop after the current step (then it checkpoints and exits);
    a second one aborts at once, leaving the previous checkpoint as the newest."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nrlvr: stopping after this step to save a checkpoint (Ctrl-C again to abort now)", flush=True)

    def __enter__(self) -> stop_on_interrupt:  # noqa: PYI034 (typing.Self needs Python 3.11)
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def fresh_run_dir(run_dir: Path) -> Path:
    """Create the run directory; a previous run there is moved aside (to NAME.prev-N), never overwritten."""
    if run_dir.is_dir() and any(run_dir.iterdir()):
        n = 1
        while run_dir.with_name(f"{run_dir.name}.prev-{n}").exists():
            n += 1
        aside = run_dir.rename(run_dir.with_name(f"{run_dir.name}.prev-{n}"))
        print(f"rlvr: {run_dir} held an earlier run; moved it to {aside}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def resume_checkpoint(cfg: RunConfig) -> Path | None:
    """The checkpoint to continue from, per ``cfg.resume`` ('' | 'auto' | path)."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        return latest_valid(Path(cfg.output_dir) / "checkpoints")
    path = Path(cfg.resume)
    if not path.is_dir():
        raise FileNotFoundError(f"resume={cfg.resume}: no such checkpoint directory")
    return path


def _sample_records(c: Collected, with_token_ids: bool) -> list[dict]:
    """Every completion sampled this step (all rounds) with its prompt's row and its reward."""
    records = []
    for r in c.rounds:
        ids = r.groups.completion_token_ids() if with_token_ids else None
        for i, (text, reward) in enumerate(zip(r.groups.texts, r.scores.total.tolist())):
            records.append({"row": r.row_ids[i // r.groups.group_size], "text": text,
                            "reward": None if math.isnan(reward) else reward, **({"token_ids": ids[i]} if ids else {})})
    return records


def _check_skips(state: dict, skipped: int, num_iterations: int, step: int, limit: int) -> None:
    state["consecutive_skips"] = state["consecutive_skips"] + 1 if skipped == num_iterations else 0
    state["skipped_updates"] += skipped
    if state["consecutive_skips"] >= limit:
        raise NonFiniteError(
            f"{state['consecutive_skips']} consecutive steps had a non-finite loss or gradient norm, so no "
            f"update was applied (weights are unchanged since step {step - state['consecutive_skips']}). "
            "Lower train.lr, check the reward functions, or raise train.max_consecutive_skips."
        )


@dataclass
class Run:
    """What a training run holds once it is set up; ``step`` is one iteration of the loop."""

    cfg: RunConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: ReferencePolicy | None
    settings: LossSettings
    data: TaskData
    rewards: list
    sampler: Sampler
    state: dict  # loop state saved in checkpoints: cursor, evaluations, skip counters, elapsed time
    run_dir: Path
    started: float

    def next_row_ids(self) -> list[int]:
        B = self.cfg.train.prompts_per_step
        ids = data_order(len(self.data.train_rows), self.cfg.train.seed, self.state["cursor"], B)
        self.state["cursor"] += B
        return ids

    def evaluate(self) -> float:
        cfg = self.cfg
        return evaluate(self.sampler, self.data.eval_rows, self.data.check, cfg.eval.batch_size,
                        cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, tuple(cfg.rollout.stop))

    def checkpoint(self, step: int) -> Path:
        elapsed = self.state["elapsed_s"] + time.perf_counter() - self.started
        return save_training_state(self.run_dir / "checkpoints", step, self.model, self.optimizer, self.scheduler,
                                   {**self.state, "elapsed_s": elapsed}, to_yaml(self.cfg), self.cfg.train.keep_last)

    def step(self, step: int) -> tuple[dict, Collected]:
        """Collect (sample, score, advantages), update, hand the new weights to the sampler; the step's metrics."""
        cfg, algo = self.cfg, self.cfg.algo
        c = collect(self.sampler, self.next_row_ids, self.data.train_rows, cfg.rollout.group_size,
                    sampling_params(cfg.rollout), self.rewards, seed=cfg.train.seed * 1_000_003 + step,
                    scale=algo.scale, adv_eps=algo.adv_eps, dynamic_sampling=algo.dynamic_sampling,
                    max_extra_rounds=algo.max_resample_rounds)
        fault_point("after_generate", step)
        batch = StepBatch.from_groups(c.groups, c.adv, c.included)
        t0 = time.perf_counter()
        with autocast(self.model, cfg.model.autocast):
            stats = train_step(self.model, self.optimizer, self.scheduler, batch, self.settings,
                               reference=self.reference, num_iterations=algo.num_iterations,
                               micro_batch_size=cfg.train.micro_batch_size, max_new_tokens=cfg.rollout.max_new_tokens,
                               max_grad_norm=cfg.train.max_grad_norm, chunk_tokens=cfg.train.logprob_chunk)
        t1 = time.perf_counter()
        self.sampler.sync(step)
        fault_point("after_update", step)
        tokens = float(batch.completion_mask.sum() + batch.prompt_mask.sum()) * algo.num_iterations
        metrics = {**collect_metrics(c, step - 1), **stats, "time_train_s": t1 - t0,
                   "train_tokens_per_s": tokens / max(t1 - t0, 1e-9), "time_sync_s": time.perf_counter() - t1,
                   **self.sampler.stats()}
        return metrics, c


def train(cfg: RunConfig) -> dict:
    """Train as configured; returns the summary also written to ``summary.json``."""
    started = time.perf_counter()
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    return_freed_memory()
    seed_everything(cfg.train.seed)
    data = load_data(cfg)  # rows, rewards and prompt lengths are checked before the model loads
    rewards = build_rewards(cfg.rewards)
    model = build_policy(data.model_dir, cfg.model)
    settings = cfg.algo.loss_settings()
    reference = ReferencePolicy(model) if settings.beta != 0.0 else None  # before any weights are restored
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train)

    checkpoint = resume_checkpoint(cfg)
    run_dir = Path(cfg.output_dir) if checkpoint else fresh_run_dir(Path(cfg.output_dir))
    state = {"eval_accuracy_before": None, "eval_accuracy": None, "skipped_updates": 0, "consecutive_skips": 0,
             "elapsed_s": 0.0, "dropped_prompts": data.dropped_prompts, "cursor": 0}
    start = 0
    if checkpoint is not None:
        state = load_training_state(checkpoint, model, optimizer, scheduler)
        start = state.pop("step")
        state.setdefault("cursor", start * cfg.train.prompts_per_step)  # checkpoints from before the cursor
        retune_optimizer(optimizer, scheduler, cfg.train)
        changes = config_changes((checkpoint / "config.yaml").read_text(), cfg)
        print(f"rlvr: resuming from {checkpoint} (step {start})"
              + (f"; changed settings apply from step {start + 1}: " + "; ".join(changes) if changes else ""))
    save_config(cfg, run_dir / "config.yaml")
    writer = MetricsWriter(run_dir, cfg.log.tensorboard, cfg.log.samples, resume_step=start if checkpoint else None)
    with contextlib.closing(build_sampler(cfg, model, data.tokenizer, run_dir)) as sampler, stop_on_interrupt() as stop:
        sampler.sync(start)  # version = optimizer steps taken; a remote sampler gets the restored weights here
        run = Run(cfg, model, optimizer, scheduler, reference, settings, data, rewards, sampler, state, run_dir,
                  started)
        if start == 0:
            state["eval_accuracy_before"] = state["eval_accuracy"] = run.evaluate()
            writer.log(0, {"eval_accuracy": state["eval_accuracy"], "dropped_prompts": state["dropped_prompts"]})
        bar = tqdm(range(start + 1, cfg.train.steps + 1), disable=not cfg.log.progress, desc=cfg.algo.preset,
                   unit="step", initial=start, total=cfg.train.steps)
        for step in bar:
            metrics, collected = run.step(step)
            if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                t0 = time.perf_counter()
                state["eval_accuracy"] = metrics["eval_accuracy"] = run.evaluate()
                metrics["time_eval_s"] = time.perf_counter() - t0
            writer.log(step, metrics)
            writer.log_samples(step, _sample_records(collected, cfg.log.sample_token_ids))
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{state['eval_accuracy']:.3f}")
            _check_skips(state, metrics["skipped_updates"], cfg.algo.num_iterations, step,
                         cfg.train.max_consecutive_skips)
            if step == cfg.train.steps or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
                run.checkpoint(step)
            if stop.requested:
                bar.close()
                writer.close()
                print(f"rlvr: interrupted; saved {run.checkpoint(step)}. Continue with resume=auto.")
                raise SystemExit(130)
    writer.close()

    saved = save_policy(model, data.tokenizer, run_dir / ("adapter" if cfg.model.lora else "model"))
    summary = {
        "eval_accuracy_before": state["eval_accuracy_before"],
        "eval_accuracy_after": state["eval_accuracy"],
        "steps": cfg.train.steps,
        "wall_time_s": state["elapsed_s"] + time.perf_counter() - started,
        "eval_size": len(data.eval_rows),
        "skipped_updates": state["skipped_updates"],
        "dropped_prompts": state["dropped_prompts"],
        "saved": str(saved),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.log.plot:
        plot_run(writer.path, run_dir / "plot.png", title=f"{cfg.model.name} · {cfg.algo.preset} · {cfg.task.name}")
    return summary
