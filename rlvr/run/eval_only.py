"""Greedy held-out accuracy of a model outside a training run (``GRPOTrainer.evaluate``), and the line both the CLI
and the Python API print at the end of a run."""

from __future__ import annotations

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
