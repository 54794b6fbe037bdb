"""The synchronous GRPO loop, top to bottom:

    sample prompts -> generate G completions each -> score -> advantages -> update -> log -> evaluate
    -> checkpoint -> save

Every source of randomness in a step is a pure function of (seed, step) - which rows, which tokens - or
is restored from the checkpoint, so a resumed run repeats the uninterrupted one bit for bit (CPU, fp32).
"""

from __future__ import annotations

import json
import math
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from rlvr.checkpoint import latest_valid, load_training_state, save_training_state
from rlvr.config import RunConfig, save_config, to_yaml
from rlvr.core import group_advantages, zero_variance_fraction
from rlvr.faults import fault_point
from rlvr.memory import return_freed_memory
from rlvr.metrics import MetricsWriter, plot_run
from rlvr.models import (
    ReferencePolicy,
    autocast,
    load_tokenizer,
    load_trainable,
    model_context,
    resolve_model_dir,
    save_policy,
    trainable_parameters,
)
from rlvr.rewards import WeightedReward, as_completions, build_reward, score_completions
from rlvr.rollout import SamplingParams, sample_groups
from rlvr.tasks import fit_prompts, load_task, reward_columns, step_indices
from rlvr.train.evaluate import evaluate
from rlvr.train.step import StepBatch, train_step


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

    def __enter__(self) -> "stop_on_interrupt":
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


def _masked_stats(values: torch.Tensor) -> tuple[float, float]:
    v = values[~torch.isnan(values)]
    if v.numel() == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std()) if v.numel() > 1 else 0.0


def train(cfg: RunConfig) -> dict:
    """Train as configured; returns the summary also written to ``summary.json``."""
    started = time.perf_counter()
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    return_freed_memory()
    seed_everything(cfg.train.seed)

    # Data, rewards and prompt lengths are checked before the model loads, so bad input fails fast.
    train_rows, eval_rows, check_name = load_task(cfg.task)
    rewards = [WeightedReward(r.name, build_reward(r.name, r.kwargs), r.weight, r.on_error, r.timeout_s) for r in cfg.rewards]
    check = build_reward(check_name)
    model_dir = resolve_model_dir(cfg.model.name)
    tokenizer = load_tokenizer(model_dir)
    room = model_context(model_dir) - cfg.rollout.max_new_tokens
    train_rows, dropped_train = fit_prompts(tokenizer, train_rows, room, cfg.task.drop_long_prompts, "train")
    eval_rows, dropped_eval = fit_prompts(tokenizer, eval_rows, room, cfg.task.drop_long_prompts, "eval")
    model = load_trainable(model_dir, cfg.lora_spec(), cfg.model.gradient_checkpointing)

    settings = cfg.algo.loss_settings()
    reference = ReferencePolicy(model) if settings.beta != 0.0 else None  # before any weights are restored
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warmup = cfg.train.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0)

    checkpoint = resume_checkpoint(cfg)
    run_dir = Path(cfg.output_dir) if checkpoint else fresh_run_dir(Path(cfg.output_dir))
    save_config(cfg, run_dir / "config.yaml")
    state = {"eval_accuracy_before": None, "eval_accuracy": None, "skipped_updates": 0, "consecutive_skips": 0,
             "elapsed_s": 0.0, "dropped_prompts": dropped_train + dropped_eval}
    start = 0
    if checkpoint is not None:
        state = load_training_state(checkpoint, model, optimizer, scheduler)
        start = state.pop("step")
        print(f"rlvr: resuming from {checkpoint} (step {start})")

    G, B = cfg.rollout.group_size, cfg.train.prompts_per_step
    rollout = cfg.rollout
    sampling = SamplingParams(rollout.temperature, rollout.top_p, rollout.top_k, rollout.max_new_tokens, tuple(rollout.stop))
    eval_tokens = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    writer = MetricsWriter(run_dir, cfg.log.tensorboard, cfg.log.samples, resume_step=start if checkpoint else None)

    def run_eval() -> float:
        with autocast(model, cfg.model.autocast):
            return evaluate(model, tokenizer, eval_rows, check, cfg.eval.batch_size, eval_tokens, tuple(rollout.stop))

    def save_checkpoint(step: int) -> Path:
        elapsed = state["elapsed_s"] + time.perf_counter() - started
        return save_training_state(run_dir / "checkpoints", step, model, optimizer, scheduler,
                                   {**state, "elapsed_s": elapsed}, to_yaml(cfg), cfg.train.keep_last)

    if start == 0:
        state["eval_accuracy_before"] = state["eval_accuracy"] = run_eval()
        writer.log(0, {"eval_accuracy": state["eval_accuracy"], "dropped_prompts": state["dropped_prompts"]})
    bar = tqdm(range(start + 1, cfg.train.steps + 1), disable=not cfg.log.progress, desc="grpo", unit="step",
               initial=start, total=cfg.train.steps)
    with stop_on_interrupt() as stop:
        for step in bar:
            # 1. prompts for this step (a pure function of seed and step)
            row_ids = step_indices(len(train_rows), B, cfg.train.seed, step - 1)
            rows = [train_rows[i] for i in row_ids]
            prompts = [r["prompt"] for r in rows]

            # 2. G completions per prompt
            t0 = time.perf_counter()
            generator = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
            with autocast(model, cfg.model.autocast):
                groups = sample_groups(model, tokenizer, prompts, G, sampling, generator, policy_version=step - 1)
            fault_point("after_generate", step)
            t1 = time.perf_counter()

            # 3. score every completion; 4. group-relative advantages
            flat_prompts = [p for p in prompts for _ in range(G)]
            completion_ids = [ids[m.bool()].tolist() for ids, m in zip(groups.completion_ids, groups.completion_mask)]
            columns = {**reward_columns(rows, G), "completion_ids": completion_ids}
            scores = score_completions(rewards, flat_prompts, as_completions(flat_prompts, groups.texts), columns)
            adv = group_advantages(scores.total, G, cfg.algo.scale, cfg.algo.adv_eps)  # [B*G]
            t2 = time.perf_counter()

            # 5. update (completions without any reward are excluded from the loss)
            included = ~torch.isnan(scores.total)
            batch = StepBatch(groups.prompt_ids, groups.prompt_mask, groups.completion_ids,
                              groups.completion_mask * included[:, None].long(), adv, G)
            with autocast(model, cfg.model.autocast):
                stats = train_step(
                    model, optimizer, scheduler, batch, settings,
                    reference=reference,
                    num_iterations=cfg.algo.num_iterations,
                    micro_batch_size=cfg.train.micro_batch_size,
                    temperature=cfg.rollout.temperature or 1.0,
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    max_grad_norm=cfg.train.max_grad_norm,
                    chunk_tokens=cfg.train.logprob_chunk,
                    share_prompt=cfg.train.share_prompt,
                    fused_head=cfg.train.fused_head,
                )
            fault_point("after_update", step)
            t3 = time.perf_counter()

            # 6. guards, logging, evaluation, checkpoint
            all_skipped = stats["skipped_updates"] == cfg.algo.num_iterations
            state["consecutive_skips"] = state["consecutive_skips"] + 1 if all_skipped else 0
            state["skipped_updates"] += stats["skipped_updates"]
            lengths = groups.completion_mask.sum(-1).float()
            prompt_copies = 1 if cfg.train.share_prompt else G
            train_tokens = float(batch.completion_mask.sum() + groups.prompt_mask.sum() * prompt_copies)
            reward_mean, reward_std = _masked_stats(scores.total)
            metrics = {
                "reward_mean": reward_mean,
                "reward_std": reward_std,
                "reward_missing_frac": float((~included).float().mean()),
                **{f"reward/{k}_{stat}": x for k, v in scores.per_function.items()
                   for stat, x in zip(("mean", "std"), _masked_stats(v))},
                **{f"reward/{k}_missing": int(torch.isnan(v).sum()) for k, v in scores.per_function.items()},
                **{f"reward/{k}_errors": 1 for k in scores.errors},
                "zero_variance_frac": zero_variance_fraction(scores.total, G),
                **stats,
                "completion_len_mean": float(lengths.mean()),
                "completion_len_max": float(lengths.max()),
                "truncated_frac": float(groups.truncated.float().mean()),
                "time_generate_s": t1 - t0,
                "time_reward_s": t2 - t1,
                "time_train_s": t3 - t2,
                "gen_tokens_per_s": float(lengths.sum()) / max(t1 - t0, 1e-9),
                "train_tokens_per_s": train_tokens * cfg.algo.num_iterations / max(t3 - t2, 1e-9),
            }
            if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                state["eval_accuracy"] = metrics["eval_accuracy"] = run_eval()
                metrics["time_eval_s"] = time.perf_counter() - t3
            writer.log(step, metrics)
            writer.log_samples(step, [
                {"row": row_ids[i // G], "text": text, "reward": None if math.isnan(r) else r,
                 **({"token_ids": completion_ids[i]} if cfg.log.sample_token_ids else {})}
                for i, (text, r) in enumerate(zip(groups.texts, scores.total.tolist()))
            ])
            bar.set_postfix(reward=f"{reward_mean:.3f}", acc=f"{state['eval_accuracy']:.3f}")
            if state["consecutive_skips"] >= cfg.train.max_consecutive_skips:
                raise NonFiniteError(
                    f"{state['consecutive_skips']} consecutive steps had a non-finite loss or gradient norm, so no "
                    f"update was applied (weights are unchanged since step {step - state['consecutive_skips']}). "
                    "Lower train.lr, check the reward functions, or raise train.max_consecutive_skips."
                )
            if step == cfg.train.steps or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
                save_checkpoint(step)
            if stop.requested:
                bar.close()
                writer.close()
                print(f"rlvr: interrupted; saved {save_checkpoint(step)}. Continue with resume=auto.")
                raise SystemExit(130)
    writer.close()

    saved = save_policy(model, tokenizer, run_dir / ("adapter" if cfg.model.lora else "model"))
    summary = {
        "eval_accuracy_before": state["eval_accuracy_before"],
        "eval_accuracy_after": state["eval_accuracy"],
        "steps": cfg.train.steps,
        "wall_time_s": state["elapsed_s"] + time.perf_counter() - started,
        "eval_size": len(eval_rows),
        "skipped_updates": state["skipped_updates"],
        "dropped_prompts": state["dropped_prompts"],
        "saved": str(saved),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.log.plot:
        plot_run(writer.path, run_dir / "plot.png", title=f"{cfg.model.name} · {cfg.algo.preset} · {cfg.task.name}")
    return summary
