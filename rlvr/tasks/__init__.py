"""Built-in tasks and dataset loading. A task is a list of rows: ``prompt`` plus answer columns."""

from __future__ import annotations

import torch

from rlvr.tasks.arithmetic import arithmetic_rows
from rlvr.tasks.jsonl import load_jsonl


def load_task(cfg) -> tuple[list[dict], list[dict], str]:
    """Train rows, held-out rows and the name of the correctness reward, from a ``TaskConfig``."""
    if cfg.name == "arithmetic":
        train, held_out = arithmetic_rows(
            cfg.digits, tuple(cfg.operators), cfg.eval_size, cfg.train_size, seed=cfg.seed, system_prompt=cfg.system_prompt
        )
        return train, held_out, cfg.eval_reward or "arithmetic_correct"
    if cfg.name == "jsonl":
        return load_jsonl(cfg.train_path), load_jsonl(cfg.eval_path)[: cfg.eval_size], cfg.eval_reward or "math_correct"
    raise ValueError(f"task.name must be arithmetic or jsonl, got {cfg.name!r}")


def reward_columns(rows: list[dict], group_size: int) -> dict[str, list]:
    """Every non-prompt column, one value per completion (each row repeated group_size times)."""
    names = sorted({k for r in rows for k in r if k != "prompt"})
    columns = {}
    for name in names:
        for i, r in enumerate(rows):
            if name not in r:
                raise KeyError(f"dataset row {i} ({r['prompt']!r:.80}) has no column {name!r} that other rows have")
        columns[name] = [r[name] for r in rows for _ in range(group_size)]
    return columns


def step_indices(num_rows: int, batch: int, seed: int, step: int) -> list[int]:
    """Row indices for ``step``: epochs of a seeded permutation, a pure function of (seed, step)."""
    perms: dict[int, torch.Tensor] = {}
    out = []
    for pos in range(step * batch, (step + 1) * batch):
        epoch, offset = divmod(pos, num_rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(int(perms[epoch][offset]))
    return out


__all__ = ["arithmetic_rows", "load_jsonl", "load_task", "reward_columns", "step_indices"]
