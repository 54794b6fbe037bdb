"""What RL could reinforce: pass@k of a model on the word-problem held-out split and the independent set.

    python benchmarks/reasoning_ceiling.py CONFIG [key=value ...] [--k 8] [--temperature 1.0] [--adapter DIR]
        [--extra-only] [--label NAME] [--out benchmarks/results/reasoning_ceiling.md]

GRPO raises the probability of completions the policy already samples; a problem none of k samples solves gives
no signal. For each set (the task's held-out split and eval.extra_path's) this measures greedy accuracy, the mean
accuracy of a sample at ``--temperature`` (pass@1) and pass@k (a problem counts when any of its k samples is
right) with the config's prompt, stop strings and precision. Appends one row per set to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe


def right_per_problem(cfg, sampler, rows, check, n: int, temperature: float) -> list[list[bool]]:
    """[problem][sample] -> right? for ``n`` samples per problem (temperature 0: one greedy sample)."""
    from rlvr.rewards import WeightedReward
    from rlvr.rollout import SamplingParams
    from rlvr.run.scoring import sample_scored

    params = SamplingParams(temperature=temperature, max_new_tokens=cfg.eval.max_new_tokens or
                            cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop))
    batch = max(1, cfg.eval.batch_size // n)
    out = []
    for start in range(0, len(rows), batch):
        got = sample_scored(sampler, rows[start: start + batch], n, params, start, [WeightedReward("check", check)])
        flat = [v == 1.0 for v in got.scores.per_function["check"]]
        out += [flat[i: i + n] for i in range(0, len(flat), n)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--adapter", type=Path, default=None, help="a trained LoRA adapter (default: the base model)")
    parser.add_argument("--extra-only", action="store_true", help="measure eval.extra_path's set only")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="benchmarks/results/reasoning_ceiling.md")
    args = parser.parse_args()
    import torch
    from tqdm import tqdm

    from rlvr.config.loading import load_config
    from rlvr.models.policy import load_causal_lm
    from rlvr.run.build import build_local_sampler, load_data

    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    data = load_data(cfg)
    model = load_causal_lm(data.model_dir)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    sampler = build_local_sampler(cfg, model.eval(), data.tokenizer)
    out = Path(args.out)
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"Written by `python benchmarks/reasoning_ceiling.py`. Machine: {describe()}.\n\n"
                       "| model | set | problems | greedy | pass@1 (T) | pass@k | k | minutes |\n"
                       "|---|---|---|---|---|---|---|---|\n")
    label = args.label or f"{cfg.model.name}{' + ' + str(args.adapter) if args.adapter else ''}"
    sets = [] if args.extra_only else [("held-out split", data.eval_rows)]
    sets += [(cfg.eval.extra_path, data.extra_rows)] if data.extra_rows else []
    for name, rows in tqdm(sets, desc="sets"):
        t0 = time.perf_counter()
        greedy = right_per_problem(cfg, sampler, rows, data.check, 1, 0.0)
        sampled = right_per_problem(cfg, sampler, rows, data.check, args.k, args.temperature)
        minutes = (time.perf_counter() - t0) / 60
        acc = sum(g[0] for g in greedy) / len(rows)
        pass1 = sum(sum(s) for s in sampled) / (len(rows) * args.k)
        pass_k = sum(any(s) for s in sampled) / len(rows)
        row = (f"| {label} | {name} | {len(rows)} | {acc:.1%} | {pass1:.1%} (T={args.temperature}) | {pass_k:.1%} | "
               f"{args.k} | {minutes:.1f} |")
        print(row, flush=True)
        with out.open("a") as f:
            f.write(row + "\n")


if __name__ == "__main__":
    main()
