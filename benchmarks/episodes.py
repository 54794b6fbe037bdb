"""Episode throughput: the same calculator episodes sampled in this process and over `rlvr serve`, each with and
without carrying the keys and values from turn to turn, against single-turn decoding, in one run.

    python benchmarks/episodes.py --rounds 3 [--adapter runs/tools/adapter]

examples/tools.yaml's setup (SmolLM2-135M-Instruct, the calculator, word problems over 2-digit products with one
worked example, T=0.7, at most 3 turns of 40 tokens), with the base model or a trained adapter (``--adapter``: the
episodes then call the tool and answer, two turns each): B prompts x G episodes per round, sampled in turn by
- in process, the turn cache (the default: rlvr.rollout.turn_cache) and whole-context prefill every turn;
- single turn: the same prompts and batch, in process, with an environment that never answers (each episode is its
  first turn: single-turn decoding through the same sampler);
- one `rlvr serve` on loopback with its prefix store (the default) and one with ``--prefix-cache-mb 0`` (each turn
  a /v1/completions request with the episode's token ids; the server batches concurrent requests).
All get the same torch threads (``--threads``). Reported: episodes/s, model tokens/s, turns and tool calls per
episode, medians over rounds after one warm-up round each.
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
from rlvr.config.loading import load_config
from rlvr.models.policy import LoraSpec, load_policy, resolve_model_dir
from rlvr.rollout import LocalSampler, SamplingParams
from rlvr.rollout.pool import ServerPool
from rlvr.rollout.remote_sampler import RemoteSampler
from rlvr.run.scoring import build_environment_setup, sample_scored
from rlvr.store.bucket import AdapterBucket
from rlvr.tasks import load_task
from tests.serving import ServerProcess


class Silent:
    """An environment that never answers: every episode is its first turn."""

    def step(self, text: str, timeout_s: float) -> list:
        return []


def _round(sampler, setup, rows, G, params, seed) -> dict:
    t0 = time.perf_counter()
    got = sample_scored(sampler, rows, G, params, seed, [], setup)
    return _measured(got.episode_stats, time.perf_counter() - t0)


def _single_turn(sampler, setup, rows, G, params, seed) -> dict:
    envs, prompt_ids = setup.start(rows, G)
    try:
        t0 = time.perf_counter()
        out = sampler.sample_episodes(prompt_ids, [Silent() for _ in envs], G, setup.params(params), seed,
                                      setup.limits)
        return _measured(out.stats, time.perf_counter() - t0)
    finally:
        for env in envs:
            env.release()


def _measured(stats, seconds: float) -> dict:
    n = len(stats.turns)
    return {"s": seconds, "episodes_per_s": n / seconds, "model_tokens_per_s": stats.model_tokens / seconds,
            "turns": sum(stats.turns) / n, "calls": stats.tools.as_metrics()["calls/_all"] / n}


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
    prefilling = LocalSampler(model, tokenizer, precision="auto", turn_cache=False)
    servers = {"rlvr serve": ServerProcess(resolve_model_dir(cfg.model.name), threads=args.threads),
               "rlvr serve --prefix-cache-mb 0": ServerProcess(resolve_model_dir(cfg.model.name), "--prefix-cache-mb",
                                                               "0", threads=args.threads)}
    names = ["in process", "in process, whole prefill each turn", "single turn, in process", *servers]
    results: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for server in servers.values():
            server.wait_ready(timeout_s=180)
        with tempfile.TemporaryDirectory() as tmp:
            remotes = {name: RemoteSampler(ServerPool([server.url]), tokenizer, model,
                                           AdapterBucket(Path(tmp) / f"bucket{i}"))
                       for i, (name, server) in enumerate(servers.items())}
            for remote in remotes.values():
                remote.sync(0)
            samplers = {"in process": local, "in process, whole prefill each turn": prefilling,
                        "single turn, in process": local, **remotes}
            B, G = args.prompts, args.group_size
            for k in range(args.rounds + 1):  # round 0 warms every sampler up
                rows = train_rows[k * B:(k + 1) * B]
                for name in names:
                    measure = _single_turn if name.startswith("single") else _round
                    r = measure(samplers[name], setup, rows, G, params, seed=k)
                    if k:
                        results[name].append(r)
                    print(f"round {k}: {name}: {r['model_tokens_per_s']:.0f} model tokens/s", flush=True)
            for remote in remotes.values():
                remote.close()
    finally:
        for server in servers.values():
            server.stop()
    med = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in results.items()}

    def ratio(a: str, b: str, key: str = "model_tokens_per_s") -> float:
        return med[a][key] / med[b][key]

    ratios = {"in_process_over_single_turn": ratio("in process", "single turn, in process"),
              "turn_cache_speedup": ratio("in process", "in process, whole prefill each turn"),
              "serve_prefix_store_speedup": ratio("rlvr serve", "rlvr serve --prefix-cache-mb 0"),
              "serve_over_in_process": ratio("rlvr serve", "in process", "episodes_per_s")}
    out = {"rounds": args.rounds, "prompts": args.prompts, "group_size": args.group_size, "threads": args.threads,
           "adapter": args.adapter, "median": med, **ratios, "machine": describe()}
    rows_md = "\n".join(
        f"| {name} | {m['s']:.1f} s | {m['episodes_per_s']:.2f} | {m['model_tokens_per_s']:.0f} | {m['turns']:.2f} | "
        f"{m['calls']:.2f} |" for name, m in med.items())
    command = f"python benchmarks/episodes.py --rounds {args.rounds}" + (f" --adapter {args.adapter}" if args.adapter
                                                                         else "")
    policy = "the adapter trained by examples/tools.yaml" if args.adapter else "the base model"
    markdown = f"""## Episodes: in process and over `rlvr serve`, with and without the turn cache (`{command}`)

`examples/tools.yaml`'s episodes ({policy}: SmolLM2-135M-Instruct, the calculator, word problems over 2-digit
products, T=0.7, at most 3 turns of 40 tokens): {args.prompts} prompts x {args.group_size} episodes per round, sampled
in turn in process (keys and values carried from turn to turn, or the whole context prefilled every turn), as
single-turn decoding (the same prompts and batch, an environment that never answers), and by two `rlvr serve`
processes on loopback (each turn one `/v1/completions` request of the episode's token ids; one with its prefix store,
one with `--prefix-cache-mb 0`), all with {args.threads} torch threads; medians over {args.rounds} rounds after a
warm-up round.

| sampler | round | episodes/s | model tokens/s | turns / episode | tool calls / episode |
|---|---|---|---|---|---|
{rows_md}

Episodes in process / single-turn decoding: **{ratios['in_process_over_single_turn']:.2f}x** model tokens/s; the turn
cache / whole prefill each turn: **{ratios['turn_cache_speedup']:.2f}x**; `rlvr serve`'s prefix store / none:
**{ratios['serve_prefix_store_speedup']:.2f}x**; over `rlvr serve` / in process:
**{ratios['serve_over_in_process']:.2f}x** episodes/s. Machine: {out['machine']}."""
    publish("episodes", out, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
