"""Evaluation outside a training run: ``rlvr eval`` (accuracy, the run's rewards and eval.metrics on the held-out
replies, the gaming check against the base model), greedy held-out accuracy for ``GRPOTrainer.evaluate``, and the
line both the CLI and the Python API print at the end of a run."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from rlvr.config.schema import RunConfig
from rlvr.run.scoring import EnvironmentObjects


def held_out_accuracy(cfg: RunConfig, model: nn.Module, environment: EnvironmentObjects | None = None) -> dict:
    """``{"eval_accuracy", "eval_size"}``: greedy accuracy of ``model`` on the run's held-out rows, as a run
    measures it (task.eval_reward's 1.0 counts as correct)."""
    from rlvr.platform.devices import resolve_device
    from rlvr.run.build import build_local_sampler, load_data
    from rlvr.run.evaluate import evaluate

    data = load_data(cfg, environment)
    try:
        model = model.to(resolve_device(cfg.train.device)).eval()
        sampler = build_local_sampler(cfg, model, data.tokenizer)
        accuracy = evaluate(sampler, data.eval_rows, data.check, cfg.eval.batch_size,
                            cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, tuple(cfg.rollout.stop),
                            data.env_setup)
    finally:
        data.close()
    return {"eval_accuracy": accuracy, "eval_size": len(data.eval_rows)}


def accuracy_line(summary: dict, run_dir: str) -> str:
    """held-out accuracy: 12.0% -> 40.0% (+28.0 points) in 3.1 min; run directory: runs/x"""
    before, after = summary["eval_accuracy_before"], summary["eval_accuracy_after"]
    if before is None or after is None:
        return (f"held-out accuracy: not measured (no held-out rows: task.eval_size 0) in "
                f"{summary['wall_time_s'] / 60:.1f} min; run directory: {run_dir}")
    return (f"held-out accuracy: {before:.1%} -> {after:.1%} ({(after - before) * 100:+.1f} points) "
            f"in {summary['wall_time_s'] / 60:.1f} min; run directory: {run_dir}")


def evaluate_model(cfg: RunConfig, run_dir: Path | None, replies_path: Path | None = None,
                   against_base: bool = False) -> dict:
    """``rlvr eval``: the base model (``run_dir`` None) or a trained run's weights on the held-out rows - accuracy,
    the run's rewards and eval.metrics on the greedy replies (rlvr.run.evaluate.HeldOut.metrics), eval.extra_path's
    accuracy; ``replies_path``: every reply with its scores as JSON lines; ``against_base``: the base model evaluated
    too (its reply and scores beside each line), and the gaming check (rlvr.run.gaming) from it to the trained
    weights."""
    import torch

    from rlvr.models.policy import load_causal_lm
    from rlvr.platform.devices import resolve_device, weight_dtype
    from rlvr.rewards import WeightedReward
    from rlvr.rewards.judge import judge_metrics
    from rlvr.run.build import build_local_sampler, build_rewards, load_data
    from rlvr.run.evaluate import environment_reward, held_out
    from rlvr.run.gaming import evaluation_record, gaming_alarm, measures

    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    data = load_data(cfg)
    rewards, metrics = build_rewards(cfg.rewards, cfg.train.device), build_rewards(cfg.eval.metrics, cfg.train.device)
    trained_full = run_dir is not None and (run_dir / "model").is_dir()
    device = resolve_device(cfg.train.device)
    dtype = weight_dtype(cfg.model.dtype, device, lora=not trained_full)  # nothing trains: bf16 on a bf16 GPU
    env = environment_reward(data.env_setup)  # episodes' own reward, weight 1 beside the run's
    weights = {r.name: r.weight for r in rewards} | ({env: 1.0} if env else {})

    def judged() -> dict[str, float]:  # every call the judges' endpoints saw since the last count, failed ones too
        return {f"eval/judge/{k}": v for k, v in judge_metrics([*rewards, *metrics]).items()}

    def run(model: nn.Module, rows: list[dict], scored: bool = True):
        sampler = build_local_sampler(cfg, model.eval(), data.tokenizer)
        return held_out(sampler, rows, data.check, cfg.eval.batch_size, cfg.eval.max_new_tokens
                        or cfg.rollout.max_new_tokens, tuple(cfg.rollout.stop), data.env_setup,
                        *((rewards, metrics) if scored else ([], [])))

    try:
        model = load_causal_lm(run_dir / "model" if trained_full else data.model_dir, dtype).to(device)
        if run_dir and (run_dir / "adapter").is_dir():
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, run_dir / "adapter", torch_device=str(device))
        result = run(model, data.eval_rows)
        name = str(run_dir / "model") if trained_full else cfg.model.name
        out = {"model": name, "trained": run_dir is not None, "eval_size": len(data.eval_rows),
               "eval_accuracy": result.accuracy, **result.metrics(weights), **judged()}
        if data.extra_rows:  # eval.extra_path
            out.update(extra_size=len(data.extra_rows), extra_accuracy=run(model, data.extra_rows, False).accuracy)
        lines = [{"prompt": r["prompt"], "reply": r["reply"], "scores": r["scores"]} for r in result.replies]
        if against_base and run_dir is not None:
            del model
            base = run(load_causal_lm(data.model_dir, dtype).to(device), data.eval_rows)
            scored = [*rewards, *([WeightedReward(env, None)] if env else [])]
            trained, independent = measures(scored, metrics, data.check_name, cfg.eval.gaming_rewards)
            names = trained + independent
            then = evaluation_record(0, {"eval/accuracy": base.accuracy, **base.metrics(weights)}, base.replies, names)
            now = evaluation_record(1, {"eval/accuracy": result.accuracy, **result.metrics(weights)}, result.replies,
                                    names)
            alarm = gaming_alarm(1, then, now, trained, independent, cfg.eval.gaming_rise or float("inf"),
                                 cfg.eval.gaming_fall or float("inf"))
            out["base"] = {"eval_accuracy": base.accuracy, **base.metrics(weights), **judged()}
            out["gaming"] = alarm.as_dict() if alarm else None
            for line, r in zip(lines, base.replies):
                line.update(base_reply=r["reply"], base_scores=r["scores"])
        if replies_path is not None:
            replies_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    finally:
        data.close()
    return out
