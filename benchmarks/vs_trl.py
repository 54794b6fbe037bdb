"""rlvr vs TRL's GRPOTrainer at identical settings, measured side by side in one run.

    pip install -e '.[bench]'                  # TRL 1.16, for this benchmark only
    python benchmarks/vs_trl.py --steps 6       # writes benchmarks/results/vs_trl.json + a BENCHMARKS.md section

Every trainer runs in its own fresh subprocess, one after the other, so peak RSS is per trainer and no
two compete for the cores. Settings shared by both: SmolLM2-135M-Instruct (fp32), the arithmetic task's
prompts, 4 prompts x G=8 per step, 32 new tokens, temperature 1 (no top-p/top-k), beta 0.04 (k3), clip
0.2, GRPO sequence-mean loss, group-std advantages, AdamW, same constant learning rate, grad-norm clip 1, seed 0,
LoRA r=16 / alpha=32 on all linear layers (or full fine-tuning). Each trainer keeps its own defaults
otherwise (TRL: gradient checkpointing on; rlvr: prompt-once forward, fused output layer, checkpointing as
each table row says).
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

B, G, NEW_TOKENS, BETA, SEED = 4, 8, 32, 0.04, 0
LR = {"lora": 5e-4, "full": 1e-5}
SYSTEM = "Reply with only the number."


def _rows():
    from rlvr.tasks import arithmetic_rows

    train, _ = arithmetic_rows(1, ("+", "*"), eval_size=100, train_size=0, seed=1234, system_prompt=SYSTEM)
    return train


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------- children
def _step_order(steps: int, seed: int) -> list[dict]:
    """The rows rlvr's sampler draws for steps 1..steps, in order (TRL is fed them unshuffled)."""
    from rlvr.tasks import data_order

    rows = _rows()
    return [rows[i] for i in data_order(len(rows), seed, 0, steps * B)]


VARIANTS = {  # rlvr's settings besides the mode: checkpointing, then what else differs from the defaults
    "on": ("on", []), "off": ("off", []),
    "on-glibc": ("on", []),  # glibc's malloc instead of the mimalloc the rlvr command preloads (RLVR_ALLOCATOR=system)
    "on-512": ("on", ["train.heap_threshold_kb=512"]),  # glibc, freed memory returned to the OS whatever faults cost
    "on-bf16": ("on", ["model.autocast=bf16"]),
}
SYSTEM_ALLOCATOR = ("on-glibc", "on-512")
VARIANT_LABELS = {"on": "checkpointing on", "off": "checkpointing off",
                  "on-glibc": "checkpointing on, glibc's malloc (`RLVR_ALLOCATOR=system`)",
                  "on-512": "checkpointing on, glibc with `train.heap_threshold_kb=512`",
                  "on-bf16": "checkpointing on, bf16 autocast training"}


def child_rlvr(mode: str, steps: int, variant: str = "on", seed: str = str(SEED)) -> dict:
    from rlvr.config.loading import load_config
    from rlvr.launch import train
    from rlvr.platform.allocator import in_use as allocator_in_use
    from rlvr.store.metrics import read_metrics

    out = Path(tempfile.mkdtemp(prefix="bench-rlvr-"))
    checkpointing, extra = VARIANTS[variant]
    cfg = load_config(None, [*extra,
        f"output_dir={out}", f"model.lora={str(mode == 'lora').lower()}", "model.lora_r=16", "model.lora_alpha=32",
        f"model.gradient_checkpointing={str(checkpointing == 'on').lower()}",
        "task.operators=[+, '*']", f"task.system_prompt={SYSTEM}",
        f"rollout.group_size={G}", f"rollout.max_new_tokens={NEW_TOKENS}", "rollout.temperature=1.0",
        "algo.preset=grpo", f"algo.beta={BETA}", f"train.steps={steps}", f"train.prompts_per_step={B}",
        f"train.micro_batch_size={B * G}", f"train.lr={LR[mode]}", f"train.seed={seed}", "train.checkpoint_every=0",
        "eval.every=0", "eval.batch_size=4", "task.eval_size=4", "log.progress=false", "log.trackers=[]",
        "log.plot=false",
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
            start = _vm("VmRSS")
            if not phases:  # the peak so far: loading the model and everything before the first step
                phases.append({"phase": "load", "start_mb": 0.0, "peak_mb": _vm("VmHWM")})
            Path("/proc/self/clear_refs").write_text("5")
            out = call(*args)
            phases.append({"phase": name, "start_mb": start, "peak_mb": _vm("VmHWM")})
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


def child_trl(mode: str, steps: int, seed: str = str(SEED)) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlvr.models.policy import resolve_model_dir
    from rlvr.rewards import build_reward

    torch.set_num_threads(os.cpu_count())
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in _step_order(steps, int(seed))])
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
        output_dir=out, per_device_train_batch_size=B * G, num_generations=G, max_completion_length=NEW_TOKENS,
        temperature=1.0, top_p=1.0, top_k=0, beta=BETA, epsilon=0.2, loss_type="grpo", scale_rewards="group",
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


def child_generation(repeats: int) -> dict:
    """Generation tokens/s: rlvr's group sampler vs HF generate(num_return_sequences=G), same prompts."""
    import torch

    from rlvr.models.policy import load_policy
    from rlvr.rollout import SamplingParams, encode_prompts, sample_groups
    from rlvr.rollout.decode_weights import decode_dtype

    torch.set_num_threads(os.cpu_count())
    model, tokenizer = load_policy("smollm2-135m-instruct", None)
    model.eval()
    dtype = decode_dtype("auto", model)  # what a run samples with here (rollout.precision=auto)
    prompts = [r["prompt"] for r in _rows()[:B]]
    ids, mask = encode_prompts(tokenizer, prompts)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    ours, theirs = [], []
    for i in range(repeats):
        started = time.perf_counter()
        groups = sample_groups(model, tokenizer, prompts, G, params, torch.Generator().manual_seed(i), dtype=dtype)
        ours.append(float(groups.completion_mask.sum()) / (time.perf_counter() - started))
        torch.manual_seed(i)
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=NEW_TOKENS, num_return_sequences=G,
                                 pad_token_id=tokenizer.pad_token_id)
        new = out[:, ids.shape[1]:]
        eos = tokenizer.eos_token_id
        lengths = [(row == eos).nonzero()[0].item() + 1 if (row == eos).any() else row.numel() for row in new]
        theirs.append(sum(lengths) / (time.perf_counter() - started))
    return {"rlvr_tokens_per_s": statistics.median(ours), "hf_generate_tokens_per_s": statistics.median(theirs),
            "rlvr_dtype": str(dtype).removeprefix("torch.")}


def child_bf16() -> dict:
    """bf16 autocast vs fp32: trainer log-probs of the same sampled completions, and forward time."""
    import torch

    from rlvr.learn.batch import StepBatch
    from rlvr.learn.forward import completion_logprobs
    from rlvr.models.policy import load_policy
    from rlvr.rollout import SamplingParams, sample_groups

    torch.set_num_threads(os.cpu_count())
    model, tokenizer = load_policy("smollm2-135m-instruct", None)
    model.eval()
    prompts = [r["prompt"] for r in _rows()[:2]]
    params = SamplingParams(max_new_tokens=16)
    groups = sample_groups(model, tokenizer, prompts, 4, params, torch.Generator().manual_seed(0))
    batch = StepBatch.from_groups(groups, torch.zeros(8))
    rows, mask = torch.arange(8), groups.completion_mask.bool()
    out = {}
    contexts = (("fp32", torch.autocast("cpu", enabled=False)), ("bf16", torch.autocast("cpu", dtype=torch.bfloat16)))
    for name, ctx in contexts:
        with torch.no_grad(), ctx:
            started = time.perf_counter()
            logp, _ = completion_logprobs(model, batch, rows, 512)
            out[f"{name}_forward_s"] = time.perf_counter() - started
        out[name] = logp[mask]
    delta = (out.pop("bf16") - out.pop("fp32")).abs()
    out.update(logp_abs_diff_mean=float(delta.mean()), logp_abs_diff_max=float(delta.max()), tokens=int(mask.sum()))
    trainer_logp = completion_logprobs(model, batch, rows, 512)[0].detach()
    gap = (groups.behaviour_logp[mask] - trainer_logp[mask]).abs()
    out["sampler_vs_trainer_fp32_abs_diff_mean"] = float(gap.mean())
    return out


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
def _run_child(*args: str) -> dict:
    cmd = [sys.executable, __file__, "--child", *args]
    done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(run: dict) -> dict:
    steps = run["step_s"]
    return {"first_step_s": steps[0], "steady_step_s": statistics.mean(steps[1:]) if len(steps) > 1 else steps[0],
            "peak_rss_mb": run["peak_rss_mb"], "reward_mean": statistics.mean(run["reward"])}


def _phase_lines(results: dict, variants: list) -> str:
    """Peak RSS by phase, in GB: before the first step (the model loaded), then the highest peak of sampling (and
    scoring) and of the update over the steps, for each rlvr row."""
    parts = []
    for mode, key, variant in variants:
        phases = results[key].get("phases") or []
        peak = {name: max((p["peak_mb"] for p in phases if p["phase"] == name), default=0.0) / 1024
                for name in ("load", "sample", "update")}
        loaded = f"{peak['load']:.2f}" if peak["load"] else "-"
        parts.append(f"{mode}, {VARIANT_LABELS[variant]}: {loaded} / {peak['sample']:.2f} / {peak['update']:.2f}")
    return ("Peak RSS by phase (GB; model loaded / sampling and scoring / the update, the highest over the steps): "
            + "; ".join(parts) + ".")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--modes", nargs="+", default=["lora", "full"])
    parser.add_argument("--child", nargs="+")
    parser.add_argument("--reward-seeds", type=int, nargs="*", default=[],
                        help="instead of the speed run: LoRA learning curves of both trainers over these seeds")
    args = parser.parse_args()
    if args.child:
        kind, rest = args.child[0], args.child[1:]
        if kind == "generation":
            result = child_generation(int(rest[0]))
        elif kind == "matmul":
            result = child_matmul_peak()
        elif kind == "bf16":
            result = child_bf16()
        else:
            if kind == "rlvr":  # as the rlvr command starts: mimalloc preloaded unless the variant says glibc
                from rlvr.platform.allocator import VARIABLE, preload_and_restart

                if rest[2:3] and rest[2] in SYSTEM_ALLOCATOR:
                    os.environ[VARIABLE] = "system"
                preload_and_restart()
            result = CHILDREN[kind](rest[0], int(rest[1]), *rest[2:])
        print(json.dumps(result))
        return

    from benchmarks.flops import training_flops
    from benchmarks.machine import describe
    from benchmarks.report import publish

    if args.reward_seeds:
        return reward_comparison(args.steps, args.reward_seeds)

    settings = {"B": B, "G": G, "new_tokens": NEW_TOKENS, "beta": BETA, "steps": args.steps}
    results: dict = {"machine": describe(), "settings": settings}
    results["matmul"] = _run_child("matmul")
    results["generation"] = _run_child("generation", "3")
    results["bf16"] = _run_child("bf16")
    runs = [(mode, "rlvr", "on") for mode in args.modes] + [(mode, "trl", "on") for mode in args.modes]
    runs += [("lora", "rlvr", v) for v in ("off", "on-glibc", "on-512", "on-bf16")] if "lora" in args.modes else []
    for mode, trainer, ckpt in runs:
        print(f"running {trainer} ({mode}, checkpointing {ckpt}) ...", flush=True)
        extra = (ckpt,) if trainer == "rlvr" else ()
        key = f"{trainer}_{mode}" + ("" if ckpt == "on" else "_" + ckpt)
        results[key] = _run_child(trainer, mode, str(args.steps), *extra)
    rows = []
    peak32, peak16 = results["matmul"]["fp32_gflops"], results["matmul"]["bf16_gflops"]
    variants = [(m, f"rlvr_{m}", "on") for m in args.modes]
    variants += [("lora", f"rlvr_lora_{v}", v) for v in ("off", "on-glibc", "on-512", "on-bf16")] \
        if "lora" in args.modes else []
    for mode, key, variant in variants:
        ours, theirs = _summary(results[key]), _summary(results[f"trl_{mode}"])
        flops = training_flops(results[key], mode, B, G, BETA)
        results[f"ratios_{key}"] = {
            "steady_step_time": ours["steady_step_s"] / theirs["steady_step_s"],
            "peak_rss": ours["peak_rss_mb"] / theirs["peak_rss_mb"],
            "train_mfu_vs_fp32_peak": flops / peak32 / 1e9,
            "train_mfu_vs_bf16_peak": flops / peak16 / 1e9,
        }
        label = f"{mode}, {VARIANT_LABELS[variant]}"
        rows.append(
            f"| {label} | {ours['first_step_s']:.1f} / {theirs['first_step_s']:.1f} | {ours['steady_step_s']:.1f} / "
            f"{theirs['steady_step_s']:.1f} (**{ours['steady_step_s'] / theirs['steady_step_s']:.2f}×**) | "
            f"{ours['peak_rss_mb'] / 1024:.2f} / {theirs['peak_rss_mb'] / 1024:.2f} GB "
            f"(**{ours['peak_rss_mb'] / theirs['peak_rss_mb']:.2f}×**) | "
            f"{ours['reward_mean']:.3f} / {theirs['reward_mean']:.3f} | "
            f"{100 * flops / peak32 / 1e9:.0f} % ({100 * flops / peak16 / 1e9:.0f} % of the bf16 peak) |"
        )
    gen, bf16 = results["generation"], results["bf16"]
    md = f"""## rlvr vs TRL GRPOTrainer (`python benchmarks/vs_trl.py --steps {args.steps}`)

Machine: {results['machine']}. Measured matmul peak in the same run: fp32 {results['matmul']['fp32_gflops']:.0f}
GFLOP/s, bf16 {results['matmul']['bf16_gflops']:.1f} GFLOP/s. Settings: SmolLM2-135M-Instruct fp32, {B} prompts ×
G={G}, {NEW_TOKENS} new tokens, temperature 1, β={BETA}, GRPO loss, {args.steps} steps (first step reported apart;
steady state = mean of the rest). Cells read rlvr / TRL; ratios are rlvr ÷ TRL (lower is better).

| rlvr setting (TRL: its defaults, checkpointing on) | first step (s) | steady step (s) | peak RSS \
| mean reward per step | rlvr training MFU vs fp32 peak (vs bf16 peak) |
|---|---|---|---|---|---|
{chr(10).join(rows)}

rlvr's defaults: `rollout.precision=auto` (on this machine: {results['generation']['rlvr_dtype']} decoding), the
allocator the `rlvr` command preloads (here: {results[variants[0][1]]['allocator']}; platform/allocator.py), TRL's
process
glibc's malloc. {_phase_lines(results, variants)}

TRL is fed the same prompts in the same order (rlvr's sampler order, `shuffle_dataset=False`); sampling
noise still differs, so mean rewards over {args.steps} steps are indicative only.

bf16 autocast on this CPU: trainer log-probs of {bf16['tokens']} sampled tokens differ from fp32 by
{bf16['logp_abs_diff_mean']:.4f} on average (max {bf16['logp_abs_diff_max']:.3f}); the forward pass took
{bf16['bf16_forward_s']:.1f} s in bf16 vs {bf16['fp32_forward_s']:.2f} s in fp32. Sampler vs trainer log-probs in
fp32: mean |Δ| = {bf16['sampler_vs_trainer_fp32_abs_diff_mean']:.1e}.

Generation alone (base model, {B} prompts × G={G}, {NEW_TOKENS} tokens, temperature 1, median of 3): rlvr's group
sampler ({gen['rlvr_dtype']} decoding, `rollout.precision=auto`) {gen['rlvr_tokens_per_s']:.0f} tokens/s vs Hugging Face
`generate(num_return_sequences={G})`
{gen['hf_generate_tokens_per_s']:.0f} tokens/s (**{gen['rlvr_tokens_per_s'] / gen['hf_generate_tokens_per_s']:.2f}×**).
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
            extra = ("on", str(seed)) if trainer == "rlvr" else (str(seed),)
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
