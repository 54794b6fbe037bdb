"""Episode throughput: the same calculator episodes sampled in this process and over `rlvr serve`, in one run.

    python benchmarks/episodes.py --rounds 3 [--adapter runs/tools/adapter]

examples/tools.yaml's setup (SmolLM2-135M-Instruct, the calculator, word problems over 2-digit products with one
worked example, T=0.7, at most 3 turns of 40 tokens), with the base model or a trained adapter (``--adapter``: the
episodes then call the tool and answer, two turns each): B prompts x G episodes per round, sampled alternately in
process (the LocalSampler, all active episodes' turns batched) and by one `rlvr serve` process on loopback (each turn a
/v1/completions request with the episode's token ids; the server batches concurrent requests). Both sides get the
same torch threads (``--threads``). Reported: episodes/s, model tokens/s, turns and tool calls per episode, medians
over rounds after one warm-up round each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from benchmarks.report import publish
from rlvr.bucket import AdapterBucket
from rlvr.config import load_config
from rlvr.models import LoraSpec, load_policy, resolve_model_dir
from rlvr.rollout import LocalSampler, SamplingParams
from rlvr.rollout.pool import ServerPool
from rlvr.rollout.remote_sampler import RemoteSampler
from rlvr.tasks import load_task
from rlvr.train.scoring import build_environment_setup, sample_scored
from tests.serving import ServerProcess


def _round(sampler, setup, rows, G, params, seed) -> dict:
    t0 = time.perf_counter()
    got = sample_scored(sampler, rows, G, params, seed, [], setup)
    seconds = time.perf_counter() - t0
    n = len(got.episode_stats.turns)
    return {"s": seconds, "episodes_per_s": n / seconds, "model_tokens_per_s": got.episode_stats.model_tokens / seconds,
            "turns": sum(got.episode_stats.turns) / n, "calls": got.episode_stats.tools.as_metrics()["calls/_all"] / n}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--adapter", default="", help="a trained LoRA adapter directory (default: the base model)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(ROOT / "examples" / "tools.yaml")
    train_rows, _, _ = load_task(cfg.task)
    if args.adapter:
        from peft import PeftModel

        base, tokenizer = load_policy(cfg.model.name, None)
        model = PeftModel.from_pretrained(base, args.adapter)
    else:
        model, tokenizer = load_policy(cfg.model.name, LoraSpec(r=16, alpha=32))  # as a run samples (B = 0: the base)
    model.eval()
    setup = build_environment_setup(cfg.env, tokenizer)
    params = SamplingParams(temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens)
    local = LocalSampler(model, tokenizer, precision="auto")  # as rlvr serve decodes by default
    server = ServerProcess(resolve_model_dir(cfg.model.name), threads=args.threads).wait_ready(timeout_s=180)
    results: dict[str, list[dict]] = {"in process": [], "rlvr serve": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            remote = RemoteSampler(ServerPool([server.url]), tokenizer, model, AdapterBucket(Path(tmp) / "bucket"))
            remote.sync(0)
            B, G = args.prompts, args.group_size
            for k in range(args.rounds + 1):  # round 0 warms both up
                rows = train_rows[k * B:(k + 1) * B]
                for name, sampler in (("in process", local), ("rlvr serve", remote)):
                    r = _round(sampler, setup, rows, G, params, seed=k)
                    if k:
                        results[name].append(r)
                    print(f"round {k}: {name}: {r['episodes_per_s']:.2f} episodes/s", flush=True)
            remote.close()
    finally:
        server.stop()
    med = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in results.items()}
    ratio = med["rlvr serve"]["episodes_per_s"] / med["in process"]["episodes_per_s"]
    out = {"rounds": args.rounds, "prompts": args.prompts, "group_size": args.group_size, "threads": args.threads,
           "adapter": args.adapter,
           "median": med, "serve_over_in_process": ratio, "machine": describe()}
    rows_md = "\n".join(
        f"| {name} | {m['s']:.1f} s | {m['episodes_per_s']:.2f} | {m['model_tokens_per_s']:.0f} | {m['turns']:.2f} | "
        f"{m['calls']:.2f} |" for name, m in med.items())
    command = f"python benchmarks/episodes.py --rounds {args.rounds}" + (f" --adapter {args.adapter}" if args.adapter
                                                                         else "")
    policy = "the adapter trained by examples/tools.yaml" if args.adapter else "the base model"
    markdown = f"""## Episodes: in process vs over `rlvr serve` (`{command}`)

`examples/tools.yaml`'s episodes ({policy}: SmolLM2-135M-Instruct, the calculator, word problems over 2-digit
products, T=0.7, at most 3 turns of 40 tokens): {args.prompts} prompts x {args.group_size} episodes per round,
sampled alternately in process
and by one `rlvr serve` on loopback (each turn one `/v1/completions` request of the episode's token ids), both with
{args.threads} torch threads; medians over {args.rounds} rounds after a warm-up round.

| sampler | round | episodes/s | model tokens/s | turns / episode | tool calls / episode |
|---|---|---|---|---|---|
{rows_md}

Over `rlvr serve` / in process: **{ratio:.2f}x** episodes/s. Machine: {out['machine']}."""
    publish("episodes", out, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
