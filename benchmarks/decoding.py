"""Generation speed: Hugging Face generate vs rlvr's group sampler with the LoRA adapter unmerged (peft's layers, as
training holds them), folded into fp32 weights, and folded into bf16 weights; what folding costs; the log-prob gap
each precision leaves for the importance weight; and fp32 vs bf16 at a ~0.4B model.

    python benchmarks/decoding.py          # writes benchmarks/results/decoding.json + a BENCHMARKS.md section

SmolLM2-135M-Instruct fp32 with a LoRA adapter (r=16, all linear layers, B ~ N(0, 0.01): a trained-looking adapter;
the cost does not depend on its values). Workloads: the speed table's 4 prompts x G=8 x 32 tokens and
8 x G=8 x 128 tokens; temperature 1, no top-k / top-p. The engines run interleaved, one after the other (never
together), each once per round after a warm-up round; the median round is reported. Tokens/s counts generated
tokens (EOS included) over wall time.
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

WORKLOADS = {"4 × G=8 × 32": (4, 8, 32), "8 × G=8 × 128": (8, 8, 128)}
ENGINES = ("hf generate", "rlvr unmerged", "rlvr folded fp32", "rlvr folded bf16")


def _prompts(n: int) -> list:
    from benchmarks.vs_trl import _rows

    return [r["prompt"] for r in _rows()[:n]]


def _engines(model, tokenizer, prompts, g, tokens):
    """name -> function(seed) returning (generated tokens, completions for the log-prob check or None)."""
    import torch

    from rlvr.models.policy import backbone_and_head
    from rlvr.rollout import SamplingParams, encode_prompts, generate_groups, sample_groups
    from rlvr.rollout.groups import eos_token_ids

    params = SamplingParams(temperature=1.0, max_new_tokens=tokens)
    ids, mask = encode_prompts(tokenizer, prompts)
    eos = eos_token_ids(model, tokenizer)

    def hf(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=tokens, num_return_sequences=g,
                                 pad_token_id=tokenizer.pad_token_id)
        new = out[:, ids.shape[1]:]
        ended = torch.isin(new, torch.tensor(eos))
        first_eos = ended.float().argmax(-1) + 1
        lengths = torch.where(ended.any(-1), first_eos, torch.full_like(first_eos, tokens))
        return int(lengths.sum()), None

    def unmerged(seed):
        with torch.no_grad():
            out = generate_groups(*backbone_and_head(model), ids, mask, g, params, eos, tokenizer.pad_token_id,
                                  torch.Generator().manual_seed(seed))
        return int(out.mask.sum()), None

    def folded(dtype):
        def run(seed):
            groups = sample_groups(model, tokenizer, prompts, g, params, torch.Generator().manual_seed(seed),
                                   dtype=dtype)
            return int(groups.completion_mask.sum()), groups
        return run

    def base(dtype):  # the base model through the same path: what an adapter should cost nothing against
        def run(seed):
            with model.disable_adapter():
                return folded(dtype)(seed)
        return run

    return {"hf generate": hf, "rlvr unmerged": unmerged, "rlvr folded fp32": folded(torch.float32),
            "rlvr folded bf16": folded(torch.bfloat16), "base model fp32": base(torch.float32),
            "base model bf16": base(torch.bfloat16)}


def _rounds(engines: dict, rounds: int) -> dict:
    rates = {name: [] for name in engines}
    last = {}
    for r in range(rounds + 1):  # round 0 warms up
        for name, run in engines.items():
            started = time.perf_counter()
            tokens, groups = run(r)
            if r:
                rates[name].append(tokens / (time.perf_counter() - started))
            last[name] = groups
    return {name: statistics.median(v) for name, v in rates.items()}, last


def _gap(model, groups) -> dict:
    """|behaviour log-prob - the fp32 trainer's| per token, and the share of importance weights beyond TIS's cap 2."""
    import torch

    from rlvr.learn.batch import StepBatch
    from rlvr.learn.forward import completion_logprobs

    n = groups.completion_ids.shape[0]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, StepBatch.from_groups(groups, torch.zeros(n)), torch.arange(n))
    m = groups.completion_mask.bool()
    delta = (logp - groups.behaviour_logp)[m]
    weight = delta.exp()  # pi_trainer / pi_behav per token
    return {"mean_abs": float(delta.abs().mean()), "max_abs": float(delta.abs().max()),
            "beyond_cap_2": float(((weight > 2) | (weight < 0.5)).float().mean()), "tokens": int(m.sum())}


def _fold_cost(model) -> dict:
    import torch

    from rlvr.rollout.decode_weights import FrozenLinear, FusedLinear, decoding

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        times = []
        for _ in range(3):
            started = time.perf_counter()
            with decoding(model, dtype) as (backbone, head):
                times.append(time.perf_counter() - started)
                layers = [m for m in backbone.modules() if isinstance(m, (FrozenLinear, FusedLinear))]
                weights = {id(w): w for w in (m.group.weight if isinstance(m, FusedLinear) else m.weight
                                              for m in layers)}
                copied = sum(w.numel() * w.element_size() for w in weights.values())
                if head.__class__.__name__ == "DecodeHead":
                    copied += head.layer.weight.numel() * head.layer.weight.element_size()
        out[name] = {"s": statistics.median(times), "bytes": copied, "layers": len(layers)}
    return out


def _bigger_model(tokenizer) -> dict:
    """fp32 vs bf16 at a ~0.4B random Llama (SmolLM2's vocabulary): decoding tokens/s, and a LoRA train pass
    (forward + backward of 32 completions) in fp32 vs under bf16 autocast, with the log-prob gaps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlvr.learn.batch import StepBatch
    from rlvr.learn.forward import completion_logprobs
    from rlvr.models.policy import LoraSpec, add_lora, autocast
    from rlvr.rollout import SamplingParams, sample_groups

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=1280, intermediate_size=3456, num_hidden_layers=20,
                         num_attention_heads=20, num_key_value_heads=5, max_position_embeddings=1024,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    model = add_lora(LlamaForCausalLM(config), LoraSpec()).eval()
    out = {"parameters": sum(p.numel() for p in model.parameters() if not p.requires_grad)}
    prompts, params = _prompts(4), SamplingParams(temperature=1.0, max_new_tokens=32)
    groups = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        sample_groups(model, tokenizer, prompts[:1], 2, SamplingParams(max_new_tokens=4), dtype=dtype)  # warm-up
        started = time.perf_counter()
        groups[name] = sample_groups(model, tokenizer, prompts, 8, params, torch.Generator().manual_seed(1),
                                     dtype=dtype)
        out[f"decode_{name}_tokens_per_s"] = float(groups[name].completion_mask.sum()) / (time.perf_counter() - started)
    out["decode_bf16_gap"] = _gap(model, groups["bf16"])
    batch = StepBatch.from_groups(groups["fp32"], torch.zeros(32))
    rows, mask = torch.arange(32), groups["fp32"].completion_mask.bool()
    logps = {}
    model.train()
    for name, mode in (("fp32", "none"), ("bf16", "bf16")):
        times = []
        for _ in range(2):
            started = time.perf_counter()
            with autocast(model, mode):
                logp, _ = completion_logprobs(model, batch, rows)
            logp[mask].sum().backward()
            times.append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
        out[f"train_{name}_s"] = min(times)
        logps[name] = logp.detach()
    out["train_bf16_gap_mean"] = float((logps["bf16"] - logps["fp32"])[mask].abs().mean())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-bigger", action="store_true", help="leave out the ~0.4B model")
    parser.add_argument("--render", action="store_true", help="rewrite the section from results/decoding.json")
    args = parser.parse_args()
    if args.render:
        import json

        from benchmarks.report import publish

        results = json.loads((ROOT / "benchmarks" / "results" / "decoding.json").read_text())
        return publish("decoding", results, _markdown(results))
    import torch

    from benchmarks.machine import describe
    from benchmarks.report import publish
    from benchmarks.vs_trl import child_matmul_peak
    from rlvr.models.policy import LoraSpec, load_policy
    from rlvr.rollout.decode_weights import bf16_matmul_hardware

    torch.set_num_threads(os.cpu_count())
    model, tokenizer = load_policy("smollm2-135m-instruct", LoraSpec(r=16, alpha=32.0))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    model.eval()
    results = {"machine": describe(), "bf16_hardware": bf16_matmul_hardware("cpu"), "matmul": child_matmul_peak(),
               "workloads": {}, "gaps": {}}
    for name, (b, g, t) in WORKLOADS.items():
        engines = _engines(model, tokenizer, _prompts(b), g, t)
        rates, last = _rounds(engines, args.rounds if t <= 32 else max(1, args.rounds - 2))
        results["workloads"][name] = rates
        if t <= 32:
            results["gaps"] = {k: _gap(model, last[f"rlvr folded {k}"]) for k in ("fp32", "bf16")}
    results["fold"] = _fold_cost(model)
    if not args.skip_bigger:
        results["bigger"] = _bigger_model(tokenizer)
    publish("decoding", results, _markdown(results))


def _markdown(r: dict) -> str:
    rows = [("| workload | HF generate | rlvr, adapter unmerged | folded fp32 | folded bf16 | base model fp32 / bf16 | "
             "best ÷ HF | adapter ÷ base (same precision) |"), "|---|---|---|---|---|---|---|---|"]
    for name, w in r["workloads"].items():
        best = "bf16" if w["rlvr folded bf16"] > w["rlvr folded fp32"] else "fp32"
        rows.append(
            f"| {name} | {w['hf generate']:.0f} | "
            f"{w['rlvr unmerged']:.0f} ({w['rlvr unmerged'] / w['hf generate']:.2f}×) | "
            f"{w['rlvr folded fp32']:.0f} ({w['rlvr folded fp32'] / w['hf generate']:.2f}×) | "
            f"{w['rlvr folded bf16']:.0f} ({w['rlvr folded bf16'] / w['hf generate']:.2f}×) | "
            f"{w['base model fp32']:.0f} / {w['base model bf16']:.0f} | "
            f"**{w[f'rlvr folded {best}'] / w['hf generate']:.2f}×** ({best}) | "
            f"{w[f'rlvr folded {best}'] / w[f'base model {best}']:.2f}× |")
    gaps = "; ".join(f"{k}: mean {v['mean_abs']:.1e}, max {v['max_abs']:.1e}, importance weights outside "
                     f"[0.5, 2]: {100 * v['beyond_cap_2']:.2f} % of {v['tokens']} tokens" for k, v in r["gaps"].items())
    fold = "; ".join(f"{k}: {1000 * v['s']:.0f} ms, {v['bytes'] / 1e6:.0f} MB for {v['layers']} layers"
                     + (" and the output layer" if k == "bf16" else "") for k, v in r["fold"].items())
    text = f"""## Decoding (`python benchmarks/decoding.py`)

Machine: {r['machine']}; bf16 matmul units: {'yes' if r['bf16_hardware'] else 'no'}. Measured matmul peak in the
same run: fp32 {r['matmul']['fp32_gflops']:.0f} GFLOP/s, bf16 {r['matmul']['bf16_gflops']:.0f} GFLOP/s.
SmolLM2-135M-Instruct fp32 with a LoRA adapter (r=16, all linear layers); temperature 1; engines interleaved, median
round. Cells: generated tokens/s (÷ HF generate). HF generate runs the peft model as training holds it.

{chr(10).join(rows)}

Folding the adapter when a generation starts (the copy is dropped when it ends): {fold}.

Log-prob gap, behaviour vs the fp32 trainer's recomputation (4 × 8 × 32 sample): {gaps}.
"""
    if "bigger" in r:
        b = r["bigger"]
        text += f"""
A random {b['parameters'] / 1e6:.0f}M-parameter Llama (hidden 1280, 20 layers, SmolLM2's vocabulary), LoRA r=16,
4 × G=8 × 32 tokens: decoding {b['decode_fp32_tokens_per_s']:.0f} tokens/s fp32 vs {b['decode_bf16_tokens_per_s']:.0f}
bf16 ({b['decode_bf16_tokens_per_s'] / b['decode_fp32_tokens_per_s']:.2f}×; bf16 gap mean
{b['decode_bf16_gap']['mean_abs']:.1e});
a LoRA forward + backward of the 32 completions {b['train_fp32_s']:.2f} s fp32 vs {b['train_bf16_s']:.2f} s under bf16
autocast ({b['train_bf16_s'] / b['train_fp32_s']:.2f}×; log-prob gap mean {b['train_bf16_gap_mean']:.1e}).
"""
    return text


if __name__ == "__main__":
    main()
