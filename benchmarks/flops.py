"""Model FLOPs of rlvr's training phase, the way MFU is usually quoted.

Per training token (the prompt counted once per group, plus every completion token): 6·N for full
fine-tuning, 4·N for LoRA on a frozen base (no weight gradients for the base), plus 2·N for the
reference forward when beta > 0. N = 134.5 M parameters for SmolLM2-135M (tied embedding counted once).
"""

from __future__ import annotations

import statistics

N_PARAMS = 134.5e6


def training_flops(run: dict, mode: str, prompts: int, group: int, beta: float) -> float:
    """Achieved model FLOP/s of the training phase, steady-state steps only."""
    per_token = (6 if mode == "full" else 4) + (2 if beta > 0 else 0)
    steady = slice(1, None) if len(run["train_s"]) > 1 else slice(None)
    pairs = zip(run["train_tokens"][steady], run["train_s"][steady])
    rates = [per_token * N_PARAMS * tokens / seconds for tokens, seconds in pairs]
    return statistics.mean(rates)
