"""Model FLOPs of rlvr's training phase, the way MFU is usually quoted, and a step's FLOP floor.

Per training token (the prompt counted once per group, plus every completion token): 6·N for full
fine-tuning, 4·N for LoRA on a frozen base (no weight gradients for the base), plus 2·N for the
reference forward when beta > 0. N = 134.5 M parameters for SmolLM2-135M (tied embedding counted once).
"""

from __future__ import annotations

import statistics

N_PARAMS = 134.5e6


def step_floor_s(run: dict, mode: str, beta: float, peaks: dict) -> float:
    """The steady step's FLOP floor in seconds: 2N per generated token at the bf16 peak (rlvr decodes in bf16 where
    the CPU has it), and the training phase's per-token FLOPs above at the fp32 peak; ``peaks``: GFLOP/s measured."""
    per_token = (6 if mode == "full" else 4) + (2 if beta > 0 else 0)
    steady = slice(1, None) if len(run["step_s"]) > 1 else slice(None)
    generation = statistics.mean(run["generated_tokens"][steady]) * 2 * N_PARAMS / (peaks["bf16_gflops"] * 1e9)
    training = statistics.mean(run["train_tokens"][steady]) * per_token * N_PARAMS / (peaks["fp32_gflops"] * 1e9)
    return generation + training
