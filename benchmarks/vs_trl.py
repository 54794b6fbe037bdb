"""rlvr vs TRL's GRPOTrainer on a sweep of configurations, measured side by side in one run.

    pip install -e '.[bench]'                        # TRL 1.16, for this benchmark only
    python benchmarks/vs_trl.py --baseline d837610    # writes benchmarks/results/vs_trl.json + a BENCHMARKS.md section

Every trainer runs in its own fresh subprocess, one after the other, so peak RSS is per trainer and no two compete
for the cores. Shared by both: SmolLM2-135M-Instruct (fp32), the arithmetic task's prompts, 4 prompts x G=8 per
step, temperature 1 (no top-p/top-k), clip 0.2, GRPO sequence-mean loss, group-std advantages, AdamW, the same
constant learning rate, grad-norm clip 1, seed 0, LoRA r=16 / alpha=32 on all linear layers (or full fine-tuning).
The configurations (CONFIGS) vary what nobody tuned for: beta 0.04 / 0, micro-batch 32 / 8, 32 / 256 new tokens,
LoRA / full. Each trainer keeps its own defaults otherwise (TRL: gradient checkpointing on, glibc's malloc; rlvr:
the allocator its command preloads, checkpointing on); rlvr is also measured on glibc's malloc and, with
``--baseline REF``, as the code of REF ran it (its package exported with ``git archive``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CODE_VARIABLE = "RLVR_BENCH_CODE"  # the baseline's rlvr package, for a before -> after row
if os.environ.get(CODE_VARIABLE):
    sys.path.insert(0, os.environ[CODE_VARIABLE])

B, G, NEW_TOKENS, BETA, SEED = 4, 8, 32, 0.04, 0
LR = {"lora": 5e-4, "full": 1e-5}
SYSTEM = "Reply with only the number."


def _rows(system: str = SYSTEM):
    from rlvr.tasks import arithmetic_rows

    train, _ = arithmetic_rows(1, ("+", "*"), eval_size=100, train_size=0, seed=1234, system_prompt=system)
    return train


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------- children
def _step_order(steps: int, seed: int, system: str = SYSTEM) -> list[dict]:
    """The rows rlvr's sampler draws for steps 1..steps, in order (TRL is fed them unshuffled)."""
    from rlvr.tasks import data_order

    rows = _rows(system)
    return [rows[i] for i in data_order(len(rows), seed, 0, steps * B)]


# The sweep: settings nobody tuned for, each against TRL at its defaults. "lora" is the benchmark's first setting.
LONG_SYSTEM = "Work it out step by step, then end with the number."  # completions that run to the length limit
CONFIGS = {
    "lora": {"mode": "lora", "new_tokens": NEW_TOKENS, "beta": BETA, "micro": B * G},
    "lora-beta0": {"mode": "lora", "new_tokens": NEW_TOKENS, "beta": 0.0, "micro": B * G},
    "lora-micro8": {"mode": "lora", "new_tokens": NEW_TOKENS, "beta": BETA, "micro": 8},
    "lora-256": {"mode": "lora", "new_tokens": 256, "beta": BETA, "micro": B * G, "system": LONG_SYSTEM},
    "full": {"mode": "full", "new_tokens": NEW_TOKENS, "beta": BETA, "micro": B * G},
}
CONFIG_LABELS = {"lora": "LoRA, β 0.04, 32 tokens, micro-batch 32", "lora-beta0": "LoRA, β 0",
                 "lora-micro8": "LoRA, micro-batch 8", "lora-256": "LoRA, 256 tokens (step-by-step prompt)",
                 "full": "full fine-tuning"}
VARIANTS = {  # rlvr's settings besides the configuration: checkpointing, then what else differs from the defaults
    "default": ("on", []), "off": ("off", []),
    "glibc": ("on", []),  # glibc's malloc instead of the mimalloc the rlvr command preloads (RLVR_ALLOCATOR=system)
    "on-512": ("on", ["train.heap_threshold_kb=512"]),  # glibc, freed memory returned to the OS whatever faults cost
    "on-bf16": ("on", ["model.autocast=bf16"]),
}
SYSTEM_ALLOCATOR = ("glibc", "on-512")
VARIANT_LABELS = {"default": "rlvr's defaults", "off": "checkpointing off",
                  "glibc": "glibc's malloc (`RLVR_ALLOCATOR=system`)",
                  "on-512": "glibc with `train.heap_threshold_kb=512`", "on-bf16": "bf16 autocast training"}


def child_rlvr(config: str, steps: int, variant: str = "default", seed: str = str(SEED)) -> dict:
    from rlvr.config.loading import load_config
    from rlvr.launch import train
    from rlvr.platform.allocator import in_use as allocator_in_use
    from rlvr.store.metrics import read_metrics

    out = Path(tempfile.mkdtemp(prefix="bench-rlvr-"))
    c = CONFIGS[config]
    checkpointing, extra = VARIANTS[variant]
    cfg = load_config(None, [*extra,
        f"output_dir={out}", f"model.lora={str(c['mode'] == 'lora').lower()}", "model.lora_r=16",
        "model.lora_alpha=32", f"model.gradient_checkpointing={str(checkpointing == 'on').lower()}",
        "task.operators=[+, '*']", f"task.system_prompt={c.get('system', SYSTEM)}",
        f"rollout.group_size={G}", f"rollout.max_new_tokens={c['new_tokens']}", "rollout.temperature=1.0",
        "algo.preset=grpo", f"algo.beta={c['beta']}", f"train.steps={steps}", f"train.prompts_per_step={B}",
        f"train.micro_batch_size={c['micro']}", f"train.lr={LR[c['mode']]}", f"train.seed={seed}",
        "train.checkpoint_every=0", "eval.every=0", "eval.batch_size=4", "task.eval_size=4", "log.progress=false",
        "log.trackers=[]", "log.plot=false",
    ])
    with phase_peaks() as phases:
        train(cfg)
    records = [r for r in read_metrics(out / "metrics.jsonl") if "rollout/reward_mean" in r]
    return {
        "step_s": [r["rollout/time_generate_s"] + r["rollout/time_reward_s"] + r["update/time_s"] for r in records],
        "generate_s": [r["rollout/time_generate_s"] for r in records],
        "train_s": [r["update/time_s"] for r in records],
        "generated_tokens": [r["rollout/completion_len_mean"] * B * G for r in records],
        "train_tokens": [r["update/tokens_per_s"] * r["update/time_s"] for r in records],
        "reward": [r["rollout/reward_mean"] for r in records],
        "peak_rss_mb": max([_peak_rss_mb(), *(p["peak_mb"] for p in phases)]),  # the resets lower ru_maxrss
        "phases": phases,
        "allocator": allocator_in_use(),
    }


def _vm(field: str) -> float:
    """/proc/self/status's ``field`` (VmRSS, VmHWM) in MB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


@contextlib.contextmanager
def phase_peaks():
    """Peak RSS of each phase of every step (sampling and scoring; the update) and RSS when it began: the loop's
    source and update wrapped, the peak reset before each (/proc/self/clear_refs; this child process only)."""
    from rlvr import launch

    phases: list[dict] = []
    loop = launch.run_loop

    def measured(name, call):
        def run(*args):
            start, faults = _vm("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if not phases:  # the peak so far: loading the model and everything before the first step
                phases.append({"phase": "load", "start_mb": 0.0, "peak_mb": _vm("VmHWM")})
            Path("/proc/self/clear_refs").write_text("5")
            out = call(*args)
            phases.append({"phase": name, "start_mb": start, "peak_mb": _vm("VmHWM"),
                           "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
            return out
        return run

    class Source:
        def __init__(self, inner):
            self.inner, self.next = inner, measured("sample", inner.next)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def wrapped(run, source, update):
        return loop(run, Source(source), measured("update", update))  # the loop only calls it

    launch.run_loop = wrapped
    try:
        yield phases
    finally:
        launch.run_loop = loop


def child_trl(config: str, steps: int, seed: str = str(SEED)) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlvr.models.policy import resolve_model_dir
    from rlvr.rewards import build_reward

    torch.set_num_threads(os.cpu_count())
    c = CONFIGS[config]
    mode = c["mode"]
    rows = _step_order(steps, int(seed), c.get("system", SYSTEM))
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    check = build_reward("arithmetic_correct")

    def arithmetic_correct(prompts, completions, answer, **kwargs):
        return check(prompts=prompts, completions=completions, answer=answer)

    marks: dict[str, list] = {"begin": [], "end": [], "reward": [], "gen_tokens": []}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks["begin"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            marks["end"].append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                marks["reward"].append(logs["reward"])
                marks["gen_tokens"].append(logs.get("completions/mean_length", 0.0) * B * G)

    out = tempfile.mkdtemp(prefix="bench-trl-")
    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=c["micro"], gradient_accumulation_steps=B * G // c["micro"],
        num_generations=G, max_completion_length=c["new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        beta=c["beta"], epsilon=0.2, loss_type="grpo", scale_rewards="group",
        num_iterations=1, learning_rate=LR[mode], lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=steps,
        logging_steps=1,
        report_to="none", use_cpu=True, bf16=False, seed=int(seed), save_strategy="no", dataloader_num_workers=0,
        shuffle_dataset=False,
    )
    peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=str(resolve_model_dir("smollm2-135m-instruct")), reward_funcs=[arithmetic_correct], args=config,
        train_dataset=dataset, peft_config=peft if mode == "lora" else None, callbacks=[Timer()],
    )
    trainer.train()
    return {
        "step_s": [e - b for b, e in zip(marks["begin"], marks["end"])],
        "generated_tokens": marks["gen_tokens"],
        "reward": marks["reward"],
        "peak_rss_mb": _peak_rss_mb(),
        "gradient_checkpointing": bool(config.gradient_checkpointing),
    }


def child_matmul_peak() -> dict:
    import torch

    torch.set_num_threads(os.cpu_count())
    out = {}
    for name, dtype, n in (("fp32", torch.float32, 2048), ("bf16", torch.bfloat16, 512)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        best = 0.0
        for _ in range(3):
            started = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - started))
        out[f"{name}_gflops"] = best / 1e9
    # torch's fp32 matmul is MKL's, which runs its AVX2 code on AMD CPUs; oneDNN's kernel shows what the FPUs do
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = 0.0
    for _ in range(4):
        started = time.perf_counter()
        torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
        best = max(best, 2 * 2048**3 / (time.perf_counter() - started))
    out["fp32_onednn_gflops"] = best / 1e9
    return out


CHILDREN = {"rlvr": child_rlvr, "trl": child_trl}


# ---------------------------------------------------------------------------------------------- parent
def _run_child(*args: str, code: str | None = None) -> dict:
    """A child's result; ``code``: a directory whose ``rlvr`` package the child imports instead of this checkout's."""
    cmd = [sys.executable, __file__, "--child", *args]
    env = {**os.environ, CODE_VARIABLE: code} if code else None
    done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(run: dict) -> dict:
    steps = run["step_s"]
    return {"first_step_s": steps[0], "steady_step_s": statistics.mean(steps[1:]) if len(steps) > 1 else steps[0],
            "peak_rss_mb": run["peak_rss_mb"], "reward_mean": statistics.mean(run["reward"])}


def _baseline_code(ref: str) -> str:
    """rlvr's package at git ``ref``, exported into a temporary directory (nothing in the repository changes)."""
    where = tempfile.mkdtemp(prefix="rlvr-baseline-")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "rlvr"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", where], input=archive.stdout, check=True)
    return where


def sweep_table(results: dict, configs: list[str], variants: list[str], baseline: str | None) -> str:
    """One row per configuration and rlvr setting: steady step and peak RSS, each ÷ TRL's, and step ÷ its floor."""
    from benchmarks.flops import step_floor_s

    rows = []
    for config in configs:
        theirs = _summary(results[f"trl_{config}"])
        c = CONFIGS[config]
        for variant in [*variants, *(["baseline"] if baseline else [])]:
            run = results[f"rlvr_{config}_{variant}"]
            ours = _summary(run)
            step, rss = ours["steady_step_s"] / theirs["steady_step_s"], ours["peak_rss_mb"] / theirs["peak_rss_mb"]
            floor = step_floor_s(run, c["mode"], c["beta"], results["matmul"])
            results[f"ratios_{config}_{variant}"] = {"steady_step_time": step, "peak_rss": rss,
                                                     "step_over_floor": ours["steady_step_s"] / floor}
            label = f"`{baseline}` (before), {run['allocator']}" if variant == "baseline" else \
                f"{VARIANT_LABELS[variant]}, {run['allocator']}"
            generate, update = (statistics.mean(run[k][1:] or run[k]) for k in ("generate_s", "train_s"))
            rows.append(
                f"| {CONFIG_LABELS[config]} | {label} | {ours['steady_step_s']:.1f} / {theirs['steady_step_s']:.1f}"
                f" (**{step:.2f}×**) | {ours['peak_rss_mb'] / 1024:.2f} / {theirs['peak_rss_mb'] / 1024:.2f} GB"
                f" (**{rss:.2f}×**) | {generate:.1f} / {update:.1f} | {ours['steady_step_s'] / floor:.1f}× | "
                f"{ours['reward_mean']:.2f} / {theirs['reward_mean']:.2f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--variants", nargs="+", default=["default", "glibc"], choices=list(VARIANTS),
                        help="rlvr's settings measured on every configuration")
    parser.add_argument("--baseline", default=None, help="git ref whose rlvr is measured beside (before -> after)")
    parser.add_argument("--child", nargs="+")
    parser.add_argument("--reward-seeds", type=int, nargs="*", default=[],
                        help="instead of the speed run: LoRA learning curves of both trainers over these seeds")
    args = parser.parse_args()
    if args.child:
        kind, rest = args.child[0], args.child[1:]
        if kind == "matmul":
            result = child_matmul_peak()
        else:
            if kind == "rlvr":  # as the rlvr command starts: mimalloc preloaded unless the variant says glibc
                from rlvr.platform.allocator import VARIABLE, preload_and_restart

                if rest[2:3] and rest[2] in SYSTEM_ALLOCATOR:
                    os.environ[VARIABLE] = "system"
                preload_and_restart()
            result = CHILDREN[kind](rest[0], int(rest[1]), *rest[2:])
        print(json.dumps(result))
        return

    from benchmarks.machine import describe
    from benchmarks.report import publish

    if args.reward_seeds:
        return reward_comparison(args.steps, args.reward_seeds)

    results: dict = {"machine": describe(), "settings": {"B": B, "G": G, "steps": args.steps, "configs": CONFIGS},
                     "baseline": args.baseline}
    results["matmul"] = _run_child("matmul")
    old = _baseline_code(args.baseline) if args.baseline else None
    for config in args.configs:
        print(f"{config}: TRL ...", flush=True)
        results[f"trl_{config}"] = _run_child("trl", config, str(args.steps))
        for variant in args.variants:
            print(f"{config}: rlvr ({variant}) ...", flush=True)
            results[f"rlvr_{config}_{variant}"] = _run_child("rlvr", config, str(args.steps), variant)
        if old:
            print(f"{config}: rlvr at {args.baseline} ...", flush=True)
            results[f"rlvr_{config}_baseline"] = _run_child("rlvr", config, str(args.steps), "default", code=old)
    command = f"python benchmarks/vs_trl.py --steps {args.steps}" + (f" --baseline {args.baseline}" if old else "")
    md = f"""## rlvr vs TRL GRPOTrainer (`{command}`)

Machine: {results['machine']}. Measured matmul peak in the same run: fp32 {results['matmul']['fp32_gflops']:.0f}
GFLOP/s (torch's), bf16 {results['matmul']['bf16_gflops']:.0f} GFLOP/s. Shared settings: SmolLM2-135M-Instruct fp32,
{B} prompts × G={G} per step, temperature 1, GRPO loss, LoRA r 16 / α 32 on all linear layers, {args.steps} steps, each
trainer in its own process, one after the other (steady step = mean of steps 2..{args.steps}). TRL 1.16 at its
defaults (gradient checkpointing on, glibc's malloc); rlvr at its defaults unless the row says otherwise. Cells read
rlvr / TRL; ratios are rlvr ÷ TRL (lower is better). Floor: 2N FLOPs per generated token at the bf16 peak, 4N (LoRA)
or 6N (full) per training token plus 2N for the reference pass at the fp32 peak.

| configuration | rlvr setting, allocator | steady step (s) | peak RSS | rlvr generate / update (s) \
| step ÷ floor | mean reward |
|---|---|---|---|---|---|---|
{sweep_table(results, args.configs, args.variants, args.baseline)}

TRL is fed the same prompts in the same order (rlvr's sampler order, `shuffle_dataset=False`); sampling noise still
differs, so the rewards over {args.steps} steps are indicative only.
"""
    publish("vs_trl", results, md)
    print(md)


def reward_comparison(steps: int, seeds: list[int]) -> None:
    """Same prompts per step for both trainers, several seeds: mean reward per step (LoRA)."""
    from benchmarks.machine import describe
    from benchmarks.report import publish

    curves: dict[str, list[list[float]]] = {"rlvr": [], "trl": []}
    for seed in seeds:
        for trainer in ("rlvr", "trl"):
            print(f"running {trainer} (lora, seed {seed}) ...", flush=True)
            extra = ("default", str(seed)) if trainer == "rlvr" else (str(seed),)
            curves[trainer].append(_run_child(trainer, "lora", str(steps), *extra)["reward"])
    mean = {k: [statistics.mean(step) for step in zip(*v)] for k, v in curves.items()}
    overall = {k: statistics.mean(x for run in v for x in run) for k, v in curves.items()}
    header = "| step | " + " | ".join(str(i + 1) for i in range(steps)) + " | mean |"
    rows = [f"| {k} | " + " | ".join(f"{x:.2f}" for x in mean[k]) + f" | **{overall[k]:.3f}** |"
            for k in ("rlvr", "trl")]
    command = f"python benchmarks/vs_trl.py --steps {steps} --reward-seeds {' '.join(map(str, seeds))}"
    md = f"""## Reward per step, rlvr vs TRL (`{command}`)

Machine: {describe()}. LoRA, same settings as the speed table; for each seed both trainers see the same prompts
in the same order. Mean training reward over {len(seeds)} seeds ({B * G} completions per step and seed):

{header}
|---|{'---|' * (steps + 1)}
{chr(10).join(rows)}
"""
    record = {"machine": describe(), "seeds": seeds, "curves": curves, "mean": mean, "overall": overall}
    publish("vs_trl_reward", record, md)
    print(md)


if __name__ == "__main__":
    main()
