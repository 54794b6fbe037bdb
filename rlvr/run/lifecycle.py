"""A training run's state and bookkeeping, for the one loop (loop.py): setting up or resuming (``open_run``),
evaluation, the bookkeeping after a step (``Run.after_step``: evaluate, log, guard, checkpoint), and the end
(``Run.finish``); and what drives the loop, as Protocols: where batches come from (``BatchSource``) and what
trains on them (``Update``)."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from rlvr.config.loading import config_changes, to_dict, to_yaml
from rlvr.config.schema import RunConfig
from rlvr.learn.collected import Collected
from rlvr.learn.learner import Learner, team_of
from rlvr.learn.sharding import SHARDED_HEAP_THRESHOLD, shard_weights, shards, whole_state_dict
from rlvr.models.offline import original_name
from rlvr.models.policy import ReferencePolicy, save_policy
from rlvr.platform.allocator import in_use as allocator_in_use
from rlvr.platform.devices import resolve_device
from rlvr.platform.distributed import SINGLE, Collectives, learner_device, world_from_env
from rlvr.platform.memory import return_freed_memory
from rlvr.rewards import WeightedReward, check_rewards
from rlvr.rewards.base import evaluation_context
from rlvr.rewards.judge import Judge, cache_snapshot, counted_apart, restore_caches
from rlvr.rollout import Sampler
from rlvr.run.build import (
    TaskData,
    build_optimizer,
    build_policy,
    build_rewards,
    build_scheduler,
    load_data,
    retune_optimizer,
)
from rlvr.run.evaluate import HeldOut, environment_reward, held_out, measure_names, summed
from rlvr.run.files import (
    absolute_paths,
    model_card,
    module_dirs,
    sample_records,
    sent_system_prompt,
    write_config,
)
from rlvr.run.gaming import evaluation_record, gaming_alarm, measures
from rlvr.run.learners import check_learners, sharded_weights
from rlvr.run.resume_checks import ResumeError, check_loop_state, check_run_dir
from rlvr.run.scoring import EnvironmentObjects
from rlvr.store.checkpoint import latest_valid, load_reference, load_training_state, read_text, save_training_state
from rlvr.store.metrics import ACCURACY, EXTRA_ACCURACY, MetricsWriter, plot_run
from rlvr.store.trackers import require_trackers


class NonFiniteError(RuntimeError):
    pass


class Silent:
    """The metric sink of a learner other than rank 0: rank 0 logs the step (its metrics are the job's)."""

    path = None

    def log(self, step: int, metrics: dict) -> None:
        pass

    def log_samples(self, step: int, samples: list[dict]) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass

    def __enter__(self) -> Silent:  # noqa: PYI034 (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc) -> None:
        pass


STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class stop_on_interrupt:
    """Ctrl-C (SIGINT), SIGTERM (what SLURM, Kubernetes, systemd and torchrun's launcher send) and SIGHUP (the
    terminal closed) ask the loop to stop after the current step: it checkpoints (rank 0 of a torchrun job) and
    exits with 128 + the signal's number (130, 143, 129). A second Ctrl-C aborts at once, leaving the previous
    checkpoint as the newest; a repeated SIGTERM or SIGHUP changes nothing (the step still ends and saves). A run
    started under ``nohup`` (SIGHUP ignored) keeps ignoring hang-ups; SIGINT and SIGTERM are always answered."""

    def __init__(self) -> None:
        self.requested = False
        self.signum = signal.SIGINT
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.requested:
            again = " (Ctrl-C again to abort now)" if signum == signal.SIGINT else ""
            print(f"\nrlvr: {signal.Signals(signum).name}: stopping after this step to save a checkpoint{again}",
                  flush=True)
            self.signum = signum
        self.requested = True

    def __enter__(self) -> stop_on_interrupt:  # noqa: PYI034 (typing.Self needs Python 3.11)
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS
                              if not (s == getattr(signal, "SIGHUP", None) and signal.getsignal(s) is signal.SIG_IGN)}
        return self

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)


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
        found = latest_valid(Path(cfg.output_dir) / "checkpoints")
        if found is None:
            print(f"rlvr: resume=auto: no complete checkpoint in {Path(cfg.output_dir) / 'checkpoints'}; starting "
                  "from step 0", flush=True)
        return found
    path = Path(cfg.resume)
    if not path.is_dir():
        raise FileNotFoundError(f"resume={cfg.resume}: no such checkpoint directory")
    return path


def check_skips(state: dict, skipped: int, num_iterations: int, step: int, limit: int) -> None:
    state["consecutive_skips"] = state["consecutive_skips"] + 1 if skipped == num_iterations else 0
    state["skipped_updates"] += skipped
    if state["consecutive_skips"] >= limit:
        raise NonFiniteError(
            f"{state['consecutive_skips']} consecutive steps had a non-finite loss or gradient norm, so no "
            f"update was applied (weights are unchanged since step {step - state['consecutive_skips']}). "
            "Lower train.lr, check the reward functions, or raise train.max_consecutive_skips."
        )


@dataclass(kw_only=True)
class Run:
    """What a training run holds once it is set up (the sampler is attached by the loop, from the batch source)."""

    cfg: RunConfig
    model: torch.nn.Module  # the policy
    trainable: torch.nn.Module  # what checkpoints hold: the policy, and (PPO) the critic
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: ReferencePolicy | None
    data: TaskData
    rewards: list
    state: dict  # loop state saved in checkpoints: data cursor, evaluations, skip counters, elapsed time
    run_dir: Path
    start: int  # steps already taken (0, or the checkpoint's step)
    writer: MetricsWriter | Silent
    started: float = field(default_factory=time.perf_counter)
    sampler: Sampler | None = None
    collectives: Collectives = field(default_factory=lambda: Collectives(SINGLE, torch.device("cpu")))
    stop: stop_on_interrupt | None = None  # the loop's: an update that waits long (DiLoCo's round) reads it
    eval_metrics: list = field(default_factory=list)  # eval.metrics, built

    @property
    def stop_requested(self) -> bool:
        return self.stop is not None and self.stop.requested

    @property
    def learner(self) -> Learner:
        """What the update takes: the policy, optimizer, schedule and reference, and the other learners."""
        return Learner(self.model, self.optimizer, self.scheduler, self.reference,
                       team_of(self.collectives, shards(self.model)))

    @property
    def main(self) -> bool:
        """This process logs, checkpoints and writes the summary (the only one, or rank 0 of a torchrun job)."""
        return self.collectives.world.main

    def evaluate(self, rows: list[dict] | None = None, scored: bool = False) -> HeldOut:
        """Greedy evaluation of the task's held-out rows (or ``rows``): accuracy and, when ``scored``, the run's
        rewards and eval.metrics on the replies (rlvr.run.evaluate); under torchrun each learner evaluates its share
        of the rows and the sums are added up (the replies stay each learner's)."""
        cfg = self.cfg
        rows = self.data.eval_rows if rows is None else rows
        mine = [rows[i] for i in self.collectives.world.share(len(rows))]
        scorers = (self.rewards, self.eval_metrics) if scored else ([], [])
        part = held_out(self.sampler, mine, self.data.check, cfg.eval.batch_size,
                        cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, tuple(cfg.rollout.stop),
                        self.data.env_setup, *scorers) if mine else HeldOut()
        if self.collectives.world.size == 1:
            return part
        return summed(part, measure_names(*scorers, self.data.env_setup if scored else None),
                      self.collectives.sum_floats)

    def evaluate_held_out(self, step: int, metrics: dict) -> None:
        """The evaluation due at ``step`` into ``metrics`` (accuracy, the rewards and eval.metrics on the held-out
        replies, eval.extra_path's accuracy) and the gaming check (rlvr.run.gaming) against the first evaluation."""
        t0 = time.perf_counter()
        cfg = self.cfg
        epoch = step * cfg.train.prompts_per_step / max(len(self.data.train_rows), 1)
        mu = cfg.algo.num_iterations
        with evaluation_context(step * mu, cfg.train.steps * mu, epoch) as logged, \
                counted_apart(list(self.judges.values()), self.rewards) as judged:  # the state after step's update
            result = self.evaluate(scored=True)
        metrics.update({f"eval/reward_log/{k}": v for k, v in logged.drain().items()})
        metrics.update({f"eval/judge/{k}": v for k, v in judged.items()})  # failed calls too: the server saw them
        self.state["eval_accuracy"] = metrics[ACCURACY] = result.accuracy
        env = environment_reward(self.data.env_setup)  # episodes' own reward, weight 1 beside the run's
        rewards = [*self.rewards, *([WeightedReward(env, None)] if env else [])]
        metrics.update(result.metrics({r.name: r.weight for r in rewards}))
        metrics["eval/time_s"] = time.perf_counter() - t0
        if self.data.extra_rows:
            t0 = time.perf_counter()
            metrics[EXTRA_ACCURACY] = self.evaluate(self.data.extra_rows).accuracy
            metrics["eval/extra_time_s"] = time.perf_counter() - t0
        trained, independent = measures(rewards, self.eval_metrics, self.data.check_name, cfg.eval.gaming_rewards)
        record = evaluation_record(step, metrics, result.replies, trained + independent)
        first = self.state.get("eval_first")
        if first is None:
            self.state["eval_first"] = record
        elif cfg.eval.gaming_rise and cfg.eval.gaming_fall:
            alarm = gaming_alarm(step, first, record, trained, independent, cfg.eval.gaming_rise, cfg.eval.gaming_fall)
            metrics["eval/gaming"] = float(alarm is not None)
            if alarm is not None:
                self.state["gaming"] = alarm.as_dict()
                if self.main:
                    print(f"rlvr: warning: {alarm.line()}", file=sys.stderr, flush=True)

    def checkpoint(self, step: int) -> Path | None:
        """Rank 0 writes (every learner holds the same weights and optimizer state; sharded ones are gathered from
        every learner first); the others write nothing."""
        sharded = shards(self.model)
        if not self.main and not sharded:
            return None
        elapsed = self.state["elapsed_s"] + time.perf_counter() - self.started
        reference = self.reference.state_tensors() if self.cfg.algo.ref_sync_steps and self.reference else None
        state = {**self.state, "elapsed_s": elapsed, "judge_cache": cache_snapshot(self.judges)}
        return save_training_state(self.run_dir / "checkpoints", step, self.trainable, self.optimizer, self.scheduler,
                                   state, to_yaml(self.cfg), self.cfg.train.keep_last, reference, write=self.main)

    @property
    def judges(self) -> dict[str, Judge]:
        return run_judges(self.rewards, self.eval_metrics)

    def refresh_reference(self, step: int) -> None:
        """Move the KL reference towards the policy each time the optimizer steps taken cross a multiple of
        algo.ref_sync_steps (TRL's sync_ref_model)."""
        every, mu = self.cfg.algo.ref_sync_steps, self.cfg.algo.num_iterations
        if every and self.reference is not None and step * mu // every > (step - 1) * mu // every:
            self.reference.refresh(self.cfg.algo.ref_mixup_alpha)

    def evaluate_before(self) -> None:
        """Held-out accuracy of the starting weights (a fresh run with held-out rows only)."""
        if self.start == 0 and self.data.eval_rows and self.cfg.eval.on_start:
            metrics = {"eval/dropped_prompts": self.state["dropped_prompts"]}
            self.evaluate_held_out(0, metrics)
            self.state["eval_accuracy_before"] = self.state["eval_accuracy"]
            self.writer.log(0, metrics)

    def after_step(self, step: int, metrics: dict, c: Collected, source_state: dict, started: float) -> None:
        """Evaluate when due, log (with the step's wall time since ``started``), guard against non-finite updates,
        checkpoint when due (with ``source_state``: the batch source's cursor)."""
        cfg = self.cfg
        due = step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0)
        if due and self.data.eval_rows:  # none: task.eval_size 0 (a run whose rewards include no correctness check)
            self.evaluate_held_out(step, metrics)
        metrics["time/step_s"] = time.perf_counter() - started
        self.writer.log(step, metrics)
        self.writer.log_samples(step, sample_records(c, self.data.train_rows, cfg.log.sample_token_ids))
        check_skips(self.state, metrics["update/skipped_updates"], cfg.algo.num_iterations, step,
                    cfg.train.max_consecutive_skips)
        self.state.update(source_state)
        self.refresh_reference(step)
        if step == cfg.train.steps or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
            self.checkpoint(step)

    def interrupted(self, step: int, signum: int = signal.SIGINT) -> None:
        """Checkpoint ``step`` and exit with 128 + ``signum`` (stop_on_interrupt)."""
        self.writer.close()
        saved = self.checkpoint(step)
        if self.main:
            print(f"rlvr: interrupted; saved {saved} ({signal.Signals(signum).name} at step {step}, exit status "
                  f"{128 + signum}). Continue with resume=auto.", flush=True)
        self.collectives.close()
        raise SystemExit(128 + signum)

    def finish(self) -> dict:
        """Save the weights (an adapter naming its base model as the user gave it, an alias as its Hub id) with a
        model card, write summary.json and the plot; returns the summary."""
        self.writer.close()
        cfg, state = self.cfg, self.state
        summary = {
            "eval_accuracy_before": state["eval_accuracy_before"],
            "eval_accuracy_after": state["eval_accuracy"],
            "steps": cfg.train.steps,
            "wall_time_s": state["elapsed_s"] + time.perf_counter() - self.started,
            "eval_size": len(self.data.eval_rows),
            "skipped_updates": state["skipped_updates"],
            "dropped_prompts": state["dropped_prompts"],
            "allocator": allocator_in_use(),  # mimalloc where the rlvr command preloaded it
            "gaming": state.get("gaming"),  # the gaming check's last alarm (rlvr.run.gaming), or None
        }
        whole = whole_state_dict(self.model) if shards(self.model) else None  # sharded: gathered by every learner
        if not self.main:  # rank 0 saves what every learner holds
            return summary
        card = model_card(cfg, state, self.run_dir, len(self.data.eval_rows))
        saved = save_policy(self.model, self.data.tokenizer, self.run_dir / ("adapter" if cfg.model.lora else "model"),
                            base_model=original_name(cfg.model.name), card=card, state_dict=whole)
        summary["saved"] = str(saved)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if cfg.log.plot:
            title = f"{cfg.model.name} · {cfg.algo.preset} · {cfg.task.name}"
            plot_run(self.writer.path, self.run_dir / "plot.png", title=title)
        return summary


def run_judges(rewards: list[WeightedReward], eval_metrics: list[WeightedReward]) -> dict[str, Judge]:
    """The run's LLM judges by name (``reward/NAME``; ``metric/NAME`` for eval.metrics): their answer caches go into
    checkpoints, so a resumed run asks no question twice."""
    named = [(f"reward/{r.name}", r.fn) for r in rewards] + [(f"metric/{r.name}", r.fn) for r in eval_metrics]
    return {name: fn for name, fn in named if isinstance(fn, Judge)}


class BatchSource(Protocol):
    """Where a step's batch comes from."""

    label: str  # before the preset on the progress bar
    metrics_section: str  # where ``report()``'s metrics are logged (``data/``, ``async/``)

    def open(self, run: Run, stack: contextlib.ExitStack) -> Sampler:
        """Start what the source needs (servers, threads; their teardown goes on ``stack``); the run's sampler."""
        ...

    def next(self, run: Run, step: int) -> Collected:
        """The scored batch for ``step``, advantages included (None when the update computes its own)."""
        ...

    def report(self) -> dict[str, float]:
        """The source's own metrics for the step just taken (logged under ``metrics_section``); may be empty."""
        ...

    def state(self) -> dict:
        """What a checkpoint must hold to resume the source (data cursor, prompts in flight)."""
        ...


class Update(Protocol):
    """What trains on a batch."""

    needs_reference: bool  # the update reads a frozen reference policy (KL)

    def attach(self, model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
        """Set up on the loaded policy: (what checkpoints hold, the parameters the optimizer trains)."""
        ...

    def __call__(self, learner: Learner, batch: Collected) -> dict[str, float]:
        """One update on ``batch``; its metrics (logged under ``update/``)."""
        ...


def open_run(cfg: RunConfig, update: Update, rewards: list[WeightedReward] | None = None,
             environment: EnvironmentObjects | None = None) -> Run:
    """Load data, rewards (``rewards``: built already, e.g. Python callables; default: from cfg.rewards), the
    episode environment (``environment``: as objects; default: from cfg.env), model, optimizer (over what
    ``update`` trains); resume from a checkpoint if asked (applying the configuration given now and printing what
    changed); prepare the run directory and metric sinks."""
    started = time.perf_counter()
    cfg = absolute_paths(cfg)  # config.yaml and checkpoints name the same files from any directory
    require_trackers(cfg.log.trackers)  # a missing wandb / trackio package fails here, before the model loads
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    if cfg.train.heap_threshold_kb:
        return_freed_memory(cfg.train.heap_threshold_kb << 10)
    seed_everything(cfg.train.seed)
    world = world_from_env()
    if world.size > 1:
        check_learners(cfg, world)  # what several learners cannot do yet fails here, in one line
    device = learner_device(resolve_device(cfg.train.device), world)  # a missing GPU fails before anything loads
    collectives = Collectives(world, device, cfg.train.collective_timeout_s)
    data = load_data(cfg, environment)  # rows, environment and prompt lengths are checked before the model loads
    cfg = sent_system_prompt(cfg, data.train_rows)  # config.yaml records the system prompt the model was sent
    rewards = build_rewards(cfg.rewards, cfg.train.device) if rewards is None else rewards
    eval_metrics = build_rewards(cfg.eval.metrics, cfg.train.device)
    environments = data.env_setup.check_environment if data.env_setup else None
    check_rewards(rewards, data.train_rows, environments=environments)  # fails here, in seconds, before the model loads
    if eval_metrics:
        check_rewards(eval_metrics, data.eval_rows or data.train_rows, environments=environments)
    model = build_policy(data.model_dir, cfg.model, device)
    reference = ReferencePolicy(model) if update.needs_reference else None  # before any weights are restored
    trainable, params = update.attach(model)
    # every learner starts from rank 0's trained weights; the frozen ones come from the same files on every learner
    collectives.broadcast_from_main([p for p in trainable.parameters() if p.requires_grad])
    if sharded_weights(cfg, world):  # FSDP2: each learner keeps its shard (rlvr/learn/sharding.py)
        if not cfg.train.heap_threshold_kb:  # FSDP's freed per-layer buffers would stay with glibc (sharding.py)
            return_freed_memory(SHARDED_HEAP_THRESHOLD)
        shard_weights(model, collectives)
        params = [p for p in trainable.parameters() if p.requires_grad]  # the shards replaced the parameters
    optimizer = build_optimizer(model, cfg.train, params)
    scheduler = build_scheduler(optimizer, cfg.train)

    checkpoint = resume_checkpoint(cfg)
    run_dir = Path(cfg.output_dir) if checkpoint or not world.main else fresh_run_dir(Path(cfg.output_dir))
    if checkpoint is not None:
        run_dir.mkdir(parents=True, exist_ok=True)  # a checkpoint path may continue into a new output_dir
        check_run_dir(run_dir)  # no planted link or FIFO among the files the run writes again
    state = {"eval_accuracy_before": None, "eval_accuracy": None, "skipped_updates": 0, "consecutive_skips": 0,
             "elapsed_s": 0.0, "dropped_prompts": data.dropped_prompts, "cursor": 0}
    start = 0
    if checkpoint is not None:
        state = load_training_state(checkpoint, trainable, optimizer, scheduler)
        if reference is not None:
            reference.load_state_tensors(load_reference(checkpoint))
        start = state.pop("step")
        check_loop_state(state, checkpoint)  # every field the loop reads, before a step runs
        try:
            restore_caches(run_judges(rewards, eval_metrics), state.pop("judge_cache", {}))
        except ValueError as err:
            raise ResumeError(f"checkpoint {checkpoint}: state.json field 'judge_cache': {err}; resume from another "
                              "checkpoint") from None
        state.setdefault("cursor", start * cfg.train.prompts_per_step)  # checkpoints from before the cursor
        retune_optimizer(optimizer, scheduler, cfg.train)
        changes = config_changes(read_text(checkpoint, "config.yaml"), cfg)  # bounded, from inside the checkpoint
        if world.main:
            print(f"rlvr: resuming from {checkpoint} (step {start})"
                  + (f"; changed settings apply from step {start + 1}: " + "; ".join(changes) if changes else ""))
    if world.size > 1 and world.main:
        backend = "nccl" if device.type == "cuda" else "gloo"
        print(f"rlvr: learners: {world.size} ({device.type}, {backend}); each samples and trains its share of the "
              f"step's {cfg.train.prompts_per_step} prompts", flush=True)
    writer: MetricsWriter | Silent = Silent()
    if world.main:
        write_config(module_dirs(cfg), run_dir / "config.yaml")  # with where its own modules came from
        writer = MetricsWriter(run_dir, cfg.log.trackers, cfg.log.samples, resume_step=start if checkpoint else None,
                               project=cfg.log.project, run_name=cfg.log.run_name, config=to_dict(cfg))
    return Run(cfg=cfg, model=model, trainable=trainable, optimizer=optimizer, scheduler=scheduler,
               reference=reference, data=data, rewards=rewards, state=state, run_dir=run_dir, start=start,
               writer=writer, started=started, collectives=collectives, eval_metrics=eval_metrics)
