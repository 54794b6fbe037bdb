"""Where one rlvr GRPO step spends its time: phases, and the operators that dominate each phase.

    python benchmarks/profile_step.py          # writes benchmarks/results/profile_step.json + a BENCHMARKS.md section

Settings match `benchmarks/vs_trl.py`'s LoRA row: SmolLM2-135M-Instruct fp32, LoRA r=16 on all linear layers,
4 prompts x G=8, 32 new tokens, temperature 1, beta 0.04, one micro-batch, activation checkpointing on.
One warm-up step runs first; the measured step's phases are then timed, and profiled (torch.profiler, CPU,
with FLOP counts for matrix products) in a second identical pass. Operator times are self times (an
operator's children excluded), as shares of the profiled pass.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")
N_PARAMS = 134.5e6  # SmolLM2-135M (tied embedding counted once), as benchmarks/flops.py


def _top_ops(prof, total_s: float, count: int = 6) -> tuple[list[dict], dict]:
    """The operators with the most self CPU time, and the matrix products' share and achieved FLOP/s."""
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
    top = [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / 1e6 / total_s}
           for e in rows]
    mm = [e for e in events if e.key in MATMUL_OPS]
    mm_s = sum(e.self_cpu_time_total for e in mm) / 1e6
    counted = [e for e in mm if e.flops]  # the profiler counts no FLOPs for oneDNN's linear
    counted_s = sum(e.self_cpu_time_total for e in counted) / 1e6
    mm_flops = sum(e.flops for e in counted)
    return top, {"share": mm_s / total_s, "gflops": mm_flops / counted_s / 1e9 if counted_s else 0.0}


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.machine import describe
    from benchmarks.report import publish
    from benchmarks.vs_trl import BETA, LR, NEW_TOKENS, B, G, _rows, child_matmul_peak
    from rlvr.core import LossSettings
    from rlvr.learn.batch import StepBatch
    from rlvr.learn.forward import completion_logprobs
    from rlvr.learn.learner import Learner
    from rlvr.learn.step import StepOptions, train_step
    from rlvr.models.policy import LoraSpec, ReferencePolicy, load_policy, trainable_parameters
    from rlvr.rollout import SamplingParams, sample_groups
    from rlvr.rollout.decode_weights import decode_dtype

    torch.set_num_threads(os.cpu_count())
    peaks = child_matmul_peak()
    peak = peaks["fp32_gflops"]
    model, tokenizer = load_policy("smollm2-135m-instruct", LoraSpec(r=16, alpha=32.0), gradient_checkpointing=True)
    reference = ReferencePolicy(model)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=LR["lora"])
    settings = LossSettings(beta=BETA)
    rows = _rows()  # the speed benchmark's prompts
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    dtype = decode_dtype("auto", model)  # what rollout.precision's default picks on this machine

    def generate(step: int):
        prompts = [r["prompt"] for r in rows[step * B : (step + 1) * B]]
        return sample_groups(model, tokenizer, prompts, G, params, torch.Generator().manual_seed(step), dtype=dtype)

    def batch_of(groups) -> StepBatch:
        adv = torch.randn(B * G, generator=torch.Generator().manual_seed(0))  # any advantages cost the same
        return StepBatch.from_groups(groups, adv)

    def reference_pass(batch: StepBatch) -> None:
        with reference.active() as ref_model, torch.no_grad():
            completion_logprobs(ref_model, batch, torch.arange(B * G), 512)

    def train(batch: StepBatch) -> None:
        train_step(Learner(model, optimizer, None, reference), batch, settings,
                   StepOptions(num_iterations=1, micro_batch_size=B * G, max_completion_tokens=NEW_TOKENS,
                               max_grad_norm=1.0))

    def timed(fn, *args) -> tuple[float, object]:
        started = time.perf_counter()
        out = fn(*args)
        return time.perf_counter() - started, out

    train(batch_of(generate(0)))  # warm-up step
    gen_s, groups = timed(generate, 1)
    batch = batch_of(groups)
    ref_s, _ = timed(reference_pass, batch)
    train_s, _ = timed(train, batch)
    tokens = int(groups.completion_mask.sum())
    train_tokens = tokens + int(groups.prompt_mask.sum())
    n = N_PARAMS
    decode_peak = peaks["bf16_gflops"] if dtype == torch.bfloat16 else peak
    floor = {"generation": 2 * n * tokens / decode_peak / 1e9, "reference_pass": 2 * n * train_tokens / peak / 1e9,
             "policy_forward_backward_update": 4 * n * train_tokens / peak / 1e9}
    result = {"machine": describe(), "matmul_fp32_gflops": peak, "matmul_bf16_gflops": peaks["bf16_gflops"],
              "matmul_fp32_onednn_gflops": peaks["fp32_onednn_gflops"],
              "decode_dtype": str(dtype).removeprefix("torch."), "generated_tokens": tokens, "floor_s": floor,
              "train_tokens": train_tokens,
              "phases_s": {"generation": gen_s, "reference_pass": ref_s,
                           "policy_forward_backward_update": train_s - ref_s}}
    for name, fn, arg in (("generation", generate, 1), ("training", train, batch)):
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            profiled_s, _ = timed(fn, arg)  # shares are of the profiled pass (the profiler adds overhead)
        top, mm = _top_ops(prof, profiled_s)
        result[name] = {"top_ops": top, "matmul": mm}
    publish("profile_step", result, _markdown(result))
    print(_markdown(result))


def _markdown(r: dict) -> str:
    phases = r["phases_s"]
    total = sum(phases.values())
    floor = r["floor_s"]
    phase_rows = "\n".join(f"| {k.replace('_', ' ')} | {v:.1f} s | {v / total:.0%} | {floor[k]:.2f} s | "
                           f"{v / floor[k]:.1f}× |" for k, v in phases.items())
    phase_rows += (f"\n| step | {total:.1f} s | | {sum(floor.values()):.2f} s | "
                   f"**{total / sum(floor.values()):.1f}×** |")
    parts = []
    bf16 = r.get("decode_dtype") == "bfloat16"
    peak_of = {"generation": r["matmul_bf16_gflops"] if bf16 else r["matmul_fp32_gflops"],
               "training": r["matmul_fp32_gflops"]}
    label_of = {"generation": "bf16" if bf16 else "fp32", "training": "fp32"}
    for name in ("generation", "training"):
        ops = ", ".join(f"`{o['op']}` {o['share']:.0%}" for o in r[name]["top_ops"])
        mm = r[name]["matmul"]
        parts.append(f"- **{name}**: matrix products take {mm['share']:.0%} of the phase; torch's (MKL's) ran at "
                     f"{mm['gflops']:.0f} GFLOP/s ({mm['gflops'] / peak_of[name]:.0%} of the measured {label_of[name]} "
                     "peak). "
                     f"Top operators by self time: {ops}.")
    onednn = r.get("matmul_fp32_onednn_gflops")
    if onednn:
        train_floor = floor["reference_pass"] + floor["policy_forward_backward_update"]
        at_onednn = floor["generation"] + train_floor * r["matmul_fp32_gflops"] / onednn
        parts.append(f"- **The fp32 peak above is MKL's**, which torch's fp32 matmul calls (on AMD CPUs MKL takes its "
                     f"AVX2 code): oneDNN's fp32 kernel reached {onednn:.0f} GFLOP/s in the same run. Against that "
                     f"peak the step's floor is {at_onednn:.2f} s and the step {total / at_onednn:.1f}× it. fp32 "
                     "sampling and the frozen base weights of a LoRA step (forward and input gradient) go to oneDNN "
                     "where it measures faster (platform/matmul.py); the adapters, the output layer and attention stay "
                     "on torch's kernels.")
    return f"""## Where a step's time goes (`python benchmarks/profile_step.py`)

Machine: {r['machine']}; measured fp32 matmul peak {r['matmul_fp32_gflops']:.0f} GFLOP/s. One LoRA step at the
speed table's settings (4 prompts × G=8, 32 new tokens, β=0.04, checkpointing on): {r['generated_tokens']}
generated tokens, {r['train_tokens']} training tokens (each prompt once per group); decoding in
{r['decode_dtype']} (`rollout.precision=auto` on this machine). FLOP floor: 2N per generated token at the measured
{r['decode_dtype']} peak ({r['matmul_bf16_gflops'] if r['decode_dtype'] == 'bfloat16' else r['matmul_fp32_gflops']:.0f}
GFLOP/s), 2N per training token for the reference pass and 4N for the LoRA forward and backward at the fp32 peak
(N = {N_PARAMS / 1e6:.1f} M).

| phase | time | share | FLOP floor | time ÷ floor |
|---|---|---|---|---|
{phase_rows}

{chr(10).join(parts)}
"""


if __name__ == "__main__":
    main()
