"""Where a long-completion step (word problems, 128 new tokens) spends its time, and what the preallocated
KV cache and the shared-prefix prefill save in generation, measured side by side in one process.

    python benchmarks/long_completions.py   # writes benchmarks/results/long_completions.json + BENCHMARKS.md

Settings: SmolLM2-135M-Instruct fp32 + LoRA r=16, the reasoning example's prompts (system message + two worked
examples + question, ~230 tokens), 8 prompts x G=8, temperature 1.0, up to 128 new tokens, no stop string.
Generation alternates three samplers, ``--rounds`` times each, on the same seeds, and checks they produce the
same tokens: the sampler before this change (transformers' DynamicCache: one torch.cat of every layer's keys
and values per token; every prompt prefilled whole), + the preallocated cache, + the common prefix (system
message and worked examples) prefilled once for the batch.

The train step (beta = 0) is timed under three micro-batch plans on the same batch, alternated: before (rows in
batch order, every micro-batch as wide as the batch's longest completion), + groups ordered by length and each
micro-batch cut to its own longest row, + rows without gradient left out (rlvr now). Two advantage sets: random
(every row carries a gradient: only the cut can save) and the group advantages of a 20 % pass rate with
``algo.negative_scale: 0`` (rows at or below their group's mean carry none). One step with beta = 0.04 times the
reference pass. The computed padding of each plan is counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

B, G, NEW_TOKENS = 8, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import DynamicCache

    from benchmarks.machine import describe
    from benchmarks.report import publish
    from rlvr.core import LossSettings, group_advantages
    from rlvr.learn import step as step_module
    from rlvr.learn.batch import StepBatch
    from rlvr.learn.learner import Learner
    from rlvr.learn.step import StepOptions, micro_batches, row_width, train_step
    from rlvr.models.policy import LoraSpec, ReferencePolicy, load_policy, trainable_parameters
    from rlvr.rollout import SamplingParams, engine, sample_groups
    from rlvr.rollout import groups as group_sampler
    from rlvr.tasks.word_problems import REASONING_SYSTEM_PROMPT, word_problem_rows

    torch.set_num_threads(os.cpu_count())
    model, tokenizer = load_policy("smollm2-135m-instruct", LoraSpec(r=16, alpha=32.0), gradient_checkpointing=False)
    train_rows, _ = word_problem_rows(10, 200, 0, REASONING_SYSTEM_PROMPT, few_shot=2)
    prompts = [r["prompt"] for r in train_rows[:B]]
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    preallocated, generate_groups = engine.preallocated_cache, engine.generate_groups
    variants = {  # (cache, share_prefix)
        "before: DynamicCache (torch.cat per token), prompts prefilled whole": (lambda capacity: DynamicCache(), 0),
        "+ preallocated KV cache": (preallocated, 0),
        "+ common prefix prefilled once (rlvr now)": (preallocated, 16),
    }

    def generate(variant):
        engine.preallocated_cache, share = variant
        group_sampler.generate_groups = lambda *a, **kw: generate_groups(*a, share_prefix=share, **kw)
        started = time.perf_counter()
        sampled = sample_groups(model, tokenizer, prompts, G, params, torch.Generator().manual_seed(1))
        return time.perf_counter() - started, sampled

    times: dict[str, list[float]] = {name: [] for name in variants}
    outputs = {}
    generate(variants["+ common prefix prefilled once (rlvr now)"])  # warm-up
    for _ in range(args.rounds):
        for name, variant in variants.items():
            seconds, sampled = generate(variant)
            times[name].append(seconds)
            outputs[name] = sampled
    engine.preallocated_cache, group_sampler.generate_groups = preallocated, generate_groups
    before, cache_only, now = outputs.values()
    same = {"cache": torch.equal(before.completion_ids, cache_only.completion_ids),
            "prefix": torch.equal(before.completion_ids, now.completion_ids)}
    sampled = now
    tokens = int(sampled.completion_mask.sum())
    width = sampled.completion_ids.shape[1]

    width_of, plan_of = row_width, micro_batches
    plans = {  # (micro-batch plan, width) as the step used them
        "before: batch order, full width": (
            lambda b, size, skip_zero_advantage: list(torch.arange(b.num_completions).split(size)),
            lambda b, rows: b.completion_ids.shape[1]),
        "+ groups by length, each micro-batch cut to its longest row": (
            lambda b, size, skip_zero_advantage: plan_of(b, size, skip_zero_advantage=False), width_of),
        "+ rows without gradient left out (rlvr now)": (plan_of, width_of),
    }
    passed = torch.rand(B * G, generator=torch.Generator().manual_seed(2)) < 0.2
    advantage_sets = {"random": torch.randn(B * G, generator=torch.Generator().manual_seed(0)),
                      "20 % pass, negative_scale 0": group_advantages(passed.float(), G, negative_scale=0.0)}
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-6)
    train_times: dict[str, dict[str, list[float]]] = {a: {p: [] for p in plans} for a in advantage_sets}
    computed: dict[str, dict[str, float]] = {a: {} for a in advantage_sets}
    for _ in range(args.rounds):
        for adv_name, adv in advantage_sets.items():
            batch = StepBatch.from_groups(sampled, adv)
            full = B * G * width_of(batch, torch.arange(B * G))
            for plan_name, (plan, plan_width) in plans.items():
                step_module.micro_batches, step_module.row_width = plan, plan_width
                rows = plan(batch, 16, skip_zero_advantage=True)
                computed[adv_name][plan_name] = sum(len(r) * plan_width(batch, r) for r in rows) / full
                started = time.perf_counter()
                train_step(Learner(model, optimizer), batch, LossSettings(beta=0.0),
                           StepOptions(micro_batch_size=16, max_completion_tokens=NEW_TOKENS))
                train_times[adv_name][plan_name].append(time.perf_counter() - started)
    step_module.micro_batches, step_module.row_width = plan_of, width_of
    batch = StepBatch.from_groups(sampled, advantage_sets["random"])
    started = time.perf_counter()
    train_step(Learner(model, optimizer, None, ReferencePolicy(model)), batch, LossSettings(beta=0.04),
               StepOptions(micro_batch_size=16, max_completion_tokens=NEW_TOKENS))
    reference_s = time.perf_counter() - started

    result = {
        "machine": describe(), "prompts": B, "group_size": G, "max_new_tokens": NEW_TOKENS,
        "prompt_tokens_mean": float(sampled.prompt_mask.sum(-1).float().mean()),
        "generated_tokens": tokens, "truncated_frac": float(sampled.truncated.float().mean()),
        "padding_frac": 1 - tokens / (B * G * width),
        "generation_s": {k: statistics.median(v) for k, v in times.items()}, "generation_rounds": times,
        "same_tokens": same,
        "positive_advantage_rows": int((advantage_sets["20 % pass, negative_scale 0"] > 0).sum()),
        "train_step_s": {a: {p: statistics.median(v) for p, v in t.items()} for a, t in train_times.items()},
        "train_rounds": train_times, "computed_positions_frac": computed, "train_step_beta_0.04_s": reference_s,
    }
    publish("long_completions", result, _markdown(result))
    print(_markdown(result))


def _markdown(r: dict) -> str:
    gen = r["generation_s"]
    tok = r["generated_tokens"]
    before = next(iter(gen.values()))
    rows = "\n".join(f"| {name} | {s:.1f} s | {tok / s:.0f} | {before / s:.2f}× |" for name, s in gen.items())
    train = r["train_step_s"]
    first = {a: next(iter(t.values())) for a, t in train.items()}
    plans = list(next(iter(train.values())))
    step_rows = "\n".join(
        f"| {p} | " + " | ".join(f"{train[a][p]:.1f} s ({first[a] / train[a][p]:.2f}×), "
                                 f"{r['computed_positions_frac'][a][p]:.0%}" for a in train) + " |" for p in plans)
    cut = min(list(f.values())[1] for f in r["computed_positions_frac"].values())
    rounds = len(next(iter(r["generation_rounds"].values())))
    heads = " | ".join(f"{a} advantages" for a in train)
    return f"""## Long completions: a 128-token word-problem step (`python benchmarks/long_completions.py`)

Machine: {r['machine']}. SmolLM2-135M-Instruct fp32 + LoRA r=16, {r['prompts']} prompts × G={r['group_size']},
prompts of {r['prompt_tokens_mean']:.0f} tokens (the reasoning example's worked examples), temperature 1, up to
{r['max_new_tokens']} new tokens: {tok} tokens generated, {r['truncated_frac']:.0%} of completions cut at the limit.

| generation (median of {rounds}, alternated in one process) | time | tokens/s | vs before |
|---|---|---|---|
{rows}

Same tokens as before: {r['same_tokens']['cache']} with the preallocated cache, {r['same_tokens']['prefix']} with the
prefix prefilled once (its keys and values come from a batch of one, so rounding differs slightly and, at
temperature 1 over 4,500 tokens, some draws can differ; the tests check equal tokens and log-probs on the tiny
model, greedy and sampled). Finished rows already left the decoding batch (and its cache);
the waste left was the cache itself (every decoded token copied every layer's keys and values of every row,
prompt included, into a new tensor) and the ~190-token system message + worked examples prefilled once per
prompt.

Train step on the same batch (β = 0, micro-batch 16, prompt shared per group, common prefix once per
micro-batch; median of {rounds}, plans alternated; each cell: time (speed-up), completion positions computed as
a share of rows × the batch's longest completion):

| micro-batch plan | {heads} |
|---|---|---|
{step_rows}

The cut saves only when no row of a micro-batch runs as long as the batch's longest completion; here
{r['truncated_frac']:.0%} of completions reach the {r['max_new_tokens']}-token limit, spread over the groups, so
{cut:.0%} of the positions remain after it on this batch.
With the 20 % pass rate {r['positive_advantage_rows']} of {r['prompts'] * r['group_size']} rows have a positive
advantage; with `algo.negative_scale: 0` the others carry no gradient (β = 0), yet the loss normaliser counts
them, so the update is the whole batch's (tested against the naive reference). The same step with β = 0.04
(reference pass; no row can be left out, since the KL term reaches every row): {r['train_step_beta_0.04_s']:.1f} s.
"""


if __name__ == "__main__":
    main()
