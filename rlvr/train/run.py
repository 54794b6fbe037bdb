"""A training run's parts, shared by the synchronous loop (sync.py) and the asynchronous learner
(rlvr/runtime/learner.py): setting up or resuming (``open_run``), one update on collected groups
(``Run.update``), the bookkeeping after a step (``Run.after_step``), and the end (``Run.finish``)."""

from __future__ import annotations

import json
import math
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlvr.baselines.ppo import Critic, ppo_step
from rlvr.checkpoint import latest_valid, load_training_state, read_text, save_training_state
from rlvr.config import RunConfig, config_changes, save_config, to_dict, to_yaml
from rlvr.core import LossSettings
from rlvr.faults import fault_point
from rlvr.memory import return_freed_memory
from rlvr.metrics import MetricsWriter, plot_run
from rlvr.models import ReferencePolicy, autocast, save_policy
from rlvr.rollout import Sampler
from rlvr.trackers import require_trackers
from rlvr.train.batch import StepBatch
from rlvr.train.build import (
    TaskData,
    build_optimizer,
    build_policy,
    build_rewards,
    build_scheduler,
    load_data,
    ppo_settings,
    retune_optimizer,
)
from rlvr.train.collect import Collected, collect_metrics
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


def sample_records(c: Collected, with_token_ids: bool) -> list[dict]:
    """Every completion sampled this step (all rounds) with its prompt's row and its reward."""
    records = []
    for r in c.rounds:
        ids = r.groups.completion_token_ids() if with_token_ids else None
        for i, (text, reward) in enumerate(zip(r.groups.texts, r.scores.total.tolist())):
            g = i // r.groups.group_size
            records.append({"row": r.row_ids[g], **({"uid": r.uids[g]} if r.uids else {}), "text": text,
                            "reward": None if math.isnan(reward) else reward, **({"token_ids": ids[i]} if ids else {})})
    return records


def check_skips(state: dict, skipped: int, num_iterations: int, step: int, limit: int) -> None:
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
    """What a training run holds once it is set up (the sampler is attached by the loop that owns it)."""

    cfg: RunConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: ReferencePolicy | None
    settings: LossSettings
    data: TaskData
    rewards: list
    state: dict  # loop state saved in checkpoints: data cursor, evaluations, skip counters, elapsed time
    run_dir: Path
    start: int  # steps already taken (0, or the checkpoint's step)
    resumed: bool
    writer: MetricsWriter
    started: float = field(default_factory=time.perf_counter)
    sampler: Sampler | None = None
    critic: Critic | None = None  # algo.name=ppo

    @property
    def trainable(self) -> torch.nn.Module:
        return checkpointed(self.model, self.critic)

    def evaluate(self) -> float:
        cfg = self.cfg
        return evaluate(self.sampler, self.data.eval_rows, self.data.check, cfg.eval.batch_size,
                        cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, tuple(cfg.rollout.stop))

    def checkpoint(self, step: int) -> Path:
        elapsed = self.state["elapsed_s"] + time.perf_counter() - self.started
        return save_training_state(self.run_dir / "checkpoints", step, self.trainable, self.optimizer, self.scheduler,
                                   {**self.state, "elapsed_s": elapsed}, to_yaml(self.cfg), self.cfg.train.keep_last)

    def evaluate_before(self) -> None:
        """Held-out accuracy of the starting weights (a fresh run only)."""
        if self.start == 0:
            self.state["eval_accuracy_before"] = self.state["eval_accuracy"] = self.evaluate()
            self.writer.log(0, {"eval_accuracy": self.state["eval_accuracy"],
                                "dropped_prompts": self.state["dropped_prompts"]})

    def update(self, c: Collected, step: int) -> dict:
        """Train on collected groups, hand the new weights to the sampler (as version ``step``); metrics."""
        cfg, algo = self.cfg, self.cfg.algo
        batch = StepBatch.from_groups(c.groups, c.adv, c.included, mask_truncated=algo.mask_truncated)
        t0 = time.perf_counter()
        common = {"reference": self.reference, "micro_batch_size": cfg.train.micro_batch_size,
                  "max_new_tokens": cfg.rollout.max_new_tokens, "max_grad_norm": cfg.train.max_grad_norm,
                  "chunk_tokens": cfg.train.logprob_chunk}
        with autocast(self.model, cfg.model.autocast):
            if self.critic is None:
                stats = train_step(self.model, self.optimizer, self.scheduler, batch, self.settings,
                                   num_iterations=algo.num_iterations, **common)
            else:
                stats = ppo_step(self.model, self.critic, self.optimizer, self.scheduler, batch, c.scores.total,
                                 self.settings, ppo_settings(cfg.ppo), **common)
        t1 = time.perf_counter()
        self.sampler.sync(step)
        fault_point("after_update", step)
        tokens = float(batch.completion_mask.sum() + batch.prompt_mask.sum()) * algo.num_iterations
        return {**collect_metrics(c, step - 1), **stats, "time_train_s": t1 - t0,
                "train_tokens_per_s": tokens / max(t1 - t0, 1e-9), "time_sync_s": time.perf_counter() - t1,
                **self.sampler.stats()}

    def after_step(self, step: int, metrics: dict, c: Collected, extra_state: dict | None = None) -> None:
        """Evaluate when due, log, guard against non-finite updates, checkpoint when due."""
        cfg = self.cfg
        if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
            t0 = time.perf_counter()
            self.state["eval_accuracy"] = metrics["eval_accuracy"] = self.evaluate()
            metrics["time_eval_s"] = time.perf_counter() - t0
        self.writer.log(step, metrics)
        self.writer.log_samples(step, sample_records(c, cfg.log.sample_token_ids))
        check_skips(self.state, metrics["skipped_updates"], cfg.algo.num_iterations, step,
                    cfg.train.max_consecutive_skips)
        self.state.update(extra_state or {})
        if step == cfg.train.steps or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
            self.checkpoint(step)

    def interrupted(self, step: int) -> None:
        self.writer.close()
        print(f"rlvr: interrupted; saved {self.checkpoint(step)}. Continue with resume=auto.")
        raise SystemExit(130)

    def finish(self) -> dict:
        """Save the weights, write summary.json and the plot; returns the summary."""
        self.writer.close()
        cfg, state = self.cfg, self.state
        saved = save_policy(self.model, self.data.tokenizer, self.run_dir / ("adapter" if cfg.model.lora else "model"))
        summary = {
            "eval_accuracy_before": state["eval_accuracy_before"],
            "eval_accuracy_after": state["eval_accuracy"],
            "steps": cfg.train.steps,
            "wall_time_s": state["elapsed_s"] + time.perf_counter() - self.started,
            "eval_size": len(self.data.eval_rows),
            "skipped_updates": state["skipped_updates"],
            "dropped_prompts": state["dropped_prompts"],
            "saved": str(saved),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if cfg.log.plot:
            title = f"{cfg.model.name} · {cfg.algo.preset} · {cfg.task.name}"
            plot_run(self.writer.path, self.run_dir / "plot.png", title=title)
        return summary


def checkpointed(model: torch.nn.Module, critic: Critic | None) -> torch.nn.Module:
    """What checkpoints hold: the policy, and the critic with PPO."""
    if critic is None:
        return model
    return torch.nn.ModuleDict({"policy": model, "critic": critic.trainable_module()})


def open_run(cfg: RunConfig) -> Run:
    """Load data, rewards, model, optimizer; resume from a checkpoint if asked (applying the configuration given
    now and printing what changed); prepare the run directory and metric sinks."""
    started = time.perf_counter()
    require_trackers(cfg.log.trackers)  # a missing wandb / trackio package fails here, before the model loads
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    if cfg.train.heap_threshold_kb:
        return_freed_memory(cfg.train.heap_threshold_kb << 10)
    seed_everything(cfg.train.seed)
    data = load_data(cfg)  # rows, rewards and prompt lengths are checked before the model loads
    rewards = build_rewards(cfg.rewards)
    model = build_policy(data.model_dir, cfg.model)
    settings = cfg.algo.loss_settings()
    ppo = cfg.algo.name == "ppo"
    needs_reference = (cfg.ppo.kl_coef != 0.0) if ppo else settings.beta != 0.0
    reference = ReferencePolicy(model) if needs_reference else None  # before any weights are restored
    critic = Critic(model) if ppo else None
    params = critic.trainable_parameters(model) if critic else None
    optimizer = build_optimizer(model, cfg.train, params)
    scheduler = build_scheduler(optimizer, cfg.train)
    trainable = checkpointed(model, critic)

    checkpoint = resume_checkpoint(cfg)
    run_dir = Path(cfg.output_dir) if checkpoint else fresh_run_dir(Path(cfg.output_dir))
    state = {"eval_accuracy_before": None, "eval_accuracy": None, "skipped_updates": 0, "consecutive_skips": 0,
             "elapsed_s": 0.0, "dropped_prompts": data.dropped_prompts, "cursor": 0}
    start = 0
    if checkpoint is not None:
        state = load_training_state(checkpoint, trainable, optimizer, scheduler)
        start = state.pop("step")
        state.setdefault("cursor", start * cfg.train.prompts_per_step)  # checkpoints from before the cursor
        retune_optimizer(optimizer, scheduler, cfg.train)
        changes = config_changes(read_text(checkpoint, "config.yaml"), cfg)  # bounded, from inside the checkpoint
        print(f"rlvr: resuming from {checkpoint} (step {start})"
              + (f"; changed settings apply from step {start + 1}: " + "; ".join(changes) if changes else ""))
    save_config(cfg, run_dir / "config.yaml")
    writer = MetricsWriter(run_dir, cfg.log.trackers, cfg.log.samples, resume_step=start if checkpoint else None,
                           project=cfg.log.project, run_name=cfg.log.run_name, config=to_dict(cfg))
    return Run(cfg, model, optimizer, scheduler, reference, settings, data, rewards, state, run_dir, start,
               checkpoint is not None, writer, started, critic=critic)
