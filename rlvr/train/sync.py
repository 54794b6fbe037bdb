"""The synchronous GRPO loop, top to bottom:

    sample prompts -> generate G completions each -> score -> advantages -> update -> log -> evaluate -> save
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from rlvr.config import RunConfig, save_config
from rlvr.core import group_advantages, zero_variance_fraction
from rlvr.metrics import MetricsWriter, plot_run
from rlvr.models import ReferencePolicy, load_policy, save_policy, trainable_parameters
from rlvr.rewards import WeightedReward, as_completions, build_reward, score_completions
from rlvr.rollout import SamplingParams, sample_groups
from rlvr.tasks import load_task, reward_columns, step_indices
from rlvr.train.evaluate import evaluate
from rlvr.train.step import StepBatch, train_step


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _masked_stats(values: torch.Tensor) -> tuple[float, float]:
    v = values[~torch.isnan(values)]
    if v.numel() == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std()) if v.numel() > 1 else 0.0


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


def train(cfg: RunConfig) -> dict:
    """Train as configured; returns the summary also written to ``summary.json``."""
    started = time.perf_counter()
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    seed_everything(cfg.train.seed)
    train_rows, eval_rows, check_name = load_task(cfg.task)  # data and rewards first: fail before the model loads
    rewards = [WeightedReward(r.name, build_reward(r.name, r.kwargs), r.weight) for r in cfg.rewards]
    check = build_reward(check_name)
    run_dir = fresh_run_dir(Path(cfg.output_dir))
    save_config(cfg, run_dir / "config.yaml")

    model, tokenizer = load_policy(cfg.model.name, cfg.lora_spec(), cfg.model.gradient_checkpointing)
    settings = cfg.algo.loss_settings()
    reference = ReferencePolicy(model) if settings.beta != 0.0 else None
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warmup = cfg.train.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0)

    G, B = cfg.rollout.group_size, cfg.train.prompts_per_step
    sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k, cfg.rollout.max_new_tokens)
    eval_tokens = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens

    def run_eval() -> float:
        return evaluate(model, tokenizer, eval_rows, check, cfg.eval.batch_size, eval_tokens)

    writer = MetricsWriter(run_dir, cfg.log.tensorboard)
    acc_before = run_eval()
    writer.log(0, {"eval_accuracy": acc_before})
    acc = acc_before
    bar = tqdm(range(1, cfg.train.steps + 1), disable=not cfg.log.progress, desc="grpo", unit="step")
    for step in bar:
        # 1. prompts for this step (a pure function of seed and step)
        rows = [train_rows[i] for i in step_indices(len(train_rows), B, cfg.train.seed, step - 1)]
        prompts = [r["prompt"] for r in rows]

        # 2. G completions per prompt
        t0 = time.perf_counter()
        generator = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
        groups = sample_groups(model, tokenizer, prompts, G, sampling, generator, policy_version=step - 1)
        t1 = time.perf_counter()

        # 3. score every completion; 4. group-relative advantages
        flat_prompts = [p for p in prompts for _ in range(G)]
        columns = {**reward_columns(rows, G), "completion_ids": [ids[m.bool()].tolist() for ids, m in zip(groups.completion_ids, groups.completion_mask)]}
        total, per_fn = score_completions(rewards, flat_prompts, as_completions(flat_prompts, groups.texts), columns)
        adv = group_advantages(total, G, cfg.algo.scale, cfg.algo.adv_eps)  # [B*G]
        t2 = time.perf_counter()

        # 5. update (completions without any reward are excluded from the loss)
        included = ~torch.isnan(total)
        batch = StepBatch(
            prompt_ids=groups.prompt_ids,
            prompt_mask=groups.prompt_mask,
            completion_ids=groups.completion_ids,
            completion_mask=groups.completion_mask * included[:, None].long(),
            adv=adv,
            group_size=G,
        )
        stats = train_step(
            model, optimizer, scheduler, batch, settings,
            reference=reference,
            num_iterations=cfg.algo.num_iterations,
            micro_batch_size=cfg.train.micro_batch_size,
            temperature=cfg.rollout.temperature or 1.0,
            max_new_tokens=cfg.rollout.max_new_tokens,
            max_grad_norm=cfg.train.max_grad_norm,
            chunk_tokens=cfg.train.logprob_chunk,
            share_prompt=cfg.train.share_prompt and not cfg.model.gradient_checkpointing,
        )
        t3 = time.perf_counter()

        # 6. log, and evaluate when due
        lengths = groups.completion_mask.sum(-1).float()
        gen_tokens = float(lengths.sum())
        prompt_copies = 1 if cfg.train.share_prompt else G
        train_tokens = float(batch.completion_mask.sum() + groups.prompt_mask.sum() * prompt_copies) * cfg.algo.num_iterations
        reward_mean, reward_std = _masked_stats(total)
        metrics = {
            "reward_mean": reward_mean,
            "reward_std": reward_std,
            "reward_missing_frac": float((~included).float().mean()),
            **{f"reward/{k}_{stat}": x for k, v in per_fn.items() for stat, x in zip(("mean", "std"), _masked_stats(v))},
            **{f"reward/{k}_missing": int(torch.isnan(v).sum()) for k, v in per_fn.items()},
            "zero_variance_frac": zero_variance_fraction(total, G),
            **stats,
            "completion_len_mean": float(lengths.mean()),
            "completion_len_max": float(lengths.max()),
            "truncated_frac": float(groups.truncated.float().mean()),
            "time_generate_s": t1 - t0,
            "time_reward_s": t2 - t1,
            "time_train_s": t3 - t2,
            "gen_tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
            "train_tokens_per_s": train_tokens / max(t3 - t2, 1e-9),
        }
        if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
            acc = metrics["eval_accuracy"] = run_eval()
            metrics["time_eval_s"] = time.perf_counter() - t3
        writer.log(step, metrics)
        bar.set_postfix(reward=f"{reward_mean:.3f}", acc=f"{acc:.3f}")

    acc_after = acc
    writer.close()
    saved = save_policy(model, tokenizer, run_dir / ("adapter" if cfg.model.lora else "model"))
    summary = {
        "eval_accuracy_before": acc_before,
        "eval_accuracy_after": acc_after,
        "steps": cfg.train.steps,
        "wall_time_s": time.perf_counter() - started,
        "eval_size": len(eval_rows),
        "saved": str(saved),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.log.plot:
        plot_run(writer.path, run_dir / "plot.png", title=f"{cfg.model.name} · {cfg.algo.preset} · {cfg.task.name}")
    return summary
