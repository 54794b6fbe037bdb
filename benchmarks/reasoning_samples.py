"""Before/after on the independently written word problems: accuracy by kind of problem, and greedy samples.

    python benchmarks/reasoning_samples.py RUN_DIR [--rows 8] [--out benchmarks/results/reasoning_samples.md]

Decodes every row of the run's eval.extra_path set greedily with the base model and with the run's adapter (the
run's own config: prompt, stop strings, precision) and writes a markdown page: accuracy per ``kind`` column before
and after, then the first ``--rows`` problems that changed with both answers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe


def decode_all(cfg, model, data) -> tuple[list[str], list[bool]]:
    from rlvr.rewards import WeightedReward
    from rlvr.rollout import SamplingParams
    from rlvr.run.build import build_local_sampler
    from rlvr.run.scoring import sample_scored

    greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                            stop=tuple(cfg.rollout.stop))
    sampler = build_local_sampler(cfg, model.eval(), data.tokenizer)
    texts, right = [], []
    for start in range(0, len(data.extra_rows), cfg.eval.batch_size):
        got = sample_scored(sampler, data.extra_rows[start: start + cfg.eval.batch_size], 1, greedy, 0,
                            [WeightedReward("check", data.check)])
        texts += got.groups.texts
        right += [bool(v == 1.0) for v in got.scores.per_function["check"]]
    return texts, right


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/reasoning_samples.md")
    args = parser.parse_args()
    import torch
    from peft import PeftModel

    from rlvr.config.loading import load_config
    from rlvr.models.policy import load_causal_lm
    from rlvr.run.build import load_data
    from rlvr.tasks.jsonl import read_jsonl

    cfg = load_config(args.run / "config.yaml", [])
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    data = load_data(cfg)
    raw = [row for _, row in read_jsonl(ROOT / cfg.eval.extra_path)]
    model = load_causal_lm(data.model_dir)
    before, right_before = decode_all(cfg, model, data)
    model = PeftModel.from_pretrained(model, args.run / "adapter")
    after, right_after = decode_all(cfg, model, data)

    kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for row, b, a in zip(raw, right_before, right_after):
        k = kinds[row.get("kind", "all")]
        k[0], k[1], k[2] = k[0] + 1, k[1] + b, k[2] + a
    lines = [f"Run `{args.run}`; {len(raw)} problems of `{cfg.eval.extra_path}`, greedy. Machine: {describe()}.", "",
             "| kind | problems | before | after |", "|---|---|---|---|"]
    for kind, (n, b, a) in sorted(kinds.items()):
        lines.append(f"| {kind} | {n} | {b} | {a} |")
    lines.append(f"| **all** | {len(raw)} | {sum(right_before)} | {sum(right_after)} |")
    lines += ["", "| problem (gold) | before | after |", "|---|---|---|"]
    shown = 0
    for row, b, a, rb, ra in zip(raw, before, after, right_before, right_after):
        if rb != ra and shown < args.rows:
            cell = lambda text, ok: text.strip().replace("\n", " / ").replace("|", "\\|") + (" **right**" if ok else "")
            lines.append(f"| {row['question']} ({row['answer']}) | {cell(b, rb)} | {cell(a, ra)} |")
            shown += 1
    (ROOT / args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"before": sum(right_before), "after": sum(right_after), "n": len(raw)}))


if __name__ == "__main__":
    main()
