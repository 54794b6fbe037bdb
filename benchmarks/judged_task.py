"""The judged task with and without its mitigations: examples/judge.yaml trained per variant and seed against its
judge, then measured by what the judge does not see.

    python benchmarks/judged_task.py [--variants unmitigated brevity maximise recipe] [--seeds 0 1 2] [--steps 40]
    python benchmarks/judged_task.py --runs DIR      # measure runs already trained, in DIR/VARIANT_sSEED

Variants (examples/judge.yaml is ``recipe``): ``unmitigated`` is the judge alone (weight-0 VADER logged beside it);
``brevity`` adds reply_form with only its length terms (one or two finished sentences), weight 1; ``recipe`` adds the
similarity term (the message and the reply under all-MiniLM-L6-v2) as a bar to clear (saturate 0.5) and reply_form
with its review and copy terms; ``maximise`` is the recipe with the raw cosine (a quantity to maximise).
Each run trains beside a judge server (`rlvr serve gemma3-270m`, 1 thread; the learner 2 threads), then `rlvr eval
RUN --against-base` measures the base model's and the trained adapter's greedy replies to the 60 held-out messages:
the judge's score, VADER (clearly positive share), how much the message explains the reply under the untrained
SmolLM2 (examples/relevance.py: the share gaining >= 0.2 nats per token), the similarity of reply and message,
length, truncation, refusals, the share that reviews the message (rlvr.rewards.format.REVIEW) and the gaming check.
Hand labels ("does the reply answer the message?") are read from docs/concepts/judge_labels.json where they exist.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.judge import start_judge
from benchmarks.machine import describe
from benchmarks.report import publish
from rlvr.rewards.format import REVIEW

EXAMPLE = ROOT / "examples" / "judge.yaml"
LABELS = ROOT / "docs" / "concepts" / "judge_labels.json"
INDEPENDENT = [{"name": "relevance:about_the_message"}]
SIMILARITY = {"name": "similarity", "kwargs": {"model": "all-minilm-l6-v2"}}


def variant(name: str, seed: int, steps: int, url: str, out: Path) -> dict:
    """examples/judge.yaml as variant ``name``, seeded, writing to ``out``, its judge at ``url``."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    judge, *_, sentiment = cfg["rewards"]
    judge["kwargs"]["base_url"] = f"{url}/v1"
    if name == "unmitigated":
        cfg["rewards"] = [judge, sentiment]
    elif name == "brevity":
        form = {"name": "reply_form", "weight": 1.0, "kwargs": {"max_sentences": 2, "max_tokens": 48,
                                                                  "reviews": False}}
        cfg["rewards"] = [judge, form, sentiment]
    elif name == "maximise":  # the recipe with similarity as a quantity to maximise instead of a bar to clear
        for r in cfg["rewards"]:
            if r["name"] == "similarity":
                r["kwargs"].pop("saturate", None)
    elif name != "recipe":
        raise SystemExit(f"unknown variant {name!r}: unmitigated, brevity, maximise or recipe")
    trains_similarity = any(r["name"] == "similarity" for r in cfg["rewards"])
    cfg["eval"]["metrics"] = INDEPENDENT + ([] if trains_similarity else [SIMILARITY])
    for key in ("train_path", "eval_path"):
        cfg["task"][key] = str(ROOT / cfg["task"][key])
    cfg.update(output_dir=str(out), import_dirs=[str(ROOT / "examples")])
    cfg["train"].update(steps=steps, seed=seed, threads=2, checkpoint_every=10, keep_last=10)
    cfg["log"] = {"progress": False, "plot": False, "trackers": []}
    return cfg


def train(cfg: dict) -> None:
    out = Path(cfg["output_dir"])
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    subprocess.run([sys.executable, "-m", "rlvr", "train", str(path)], cwd=ROOT, check=True)


def measure(run: Path, url: str, again: bool = False) -> dict:
    """The run's curves (metrics.jsonl) and `rlvr eval --against-base`'s held-out measures, with the replies; kept
    in RUN/measure.json and read from there next time (unless ``again``)."""
    kept = run / "measure.json"
    if kept.is_file() and not again:
        return json.loads(kept.read_text())
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    for r in cfg["rewards"]:
        if r["name"] == "judge":
            r["kwargs"]["base_url"] = f"{url}/v1"
    trains_similarity = any(r["name"] == "similarity" for r in cfg["rewards"])
    metrics = INDEPENDENT + ([] if trains_similarity else [SIMILARITY])
    replies = run / "held_out.jsonl"
    done = subprocess.run([sys.executable, "-m", "rlvr", "eval", str(run), f"rewards={json.dumps(cfg['rewards'])}",
                           f"eval.metrics={json.dumps(metrics)}", "eval.gaming_rewards=[judge]", "train.threads=2",
                           "--replies", str(replies),
                           "--against-base"], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "RLVR_FP32_MATMUL": "blas"})  # the same replies whatever the load
    result = json.loads(done.stdout.strip().splitlines()[-1])
    lines = [json.loads(line) for line in replies.read_text().splitlines()]
    review = re.compile(REVIEW, re.IGNORECASE)
    for side, key in (("base", "base_reply"), ("after", "reply")):
        part = result["base"] if side == "base" else result
        part["review_share"] = sum(bool(review.search(x[key])) for x in lines) / len(lines)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = [{"step": r["step"], "judge": r.get("rollout/reward/judge_mean")} for r in rows
             if "rollout/reward/judge_mean" in r]
    evals = [{k: v for k, v in r.items() if k == "step" or k.startswith("eval/")} for r in rows
             if "eval/accuracy" in r]
    out = {"eval": result, "curve": curve, "evals": evals, "replies": lines}
    kept.write_text(json.dumps(out))
    return out


def hand_labels(name: str, lines: list[dict], key: str) -> list[dict] | None:
    """The hand labels of run ``name`` (``base``: the base model's replies) for the replies in ``lines[i][key]``:
    only labels of exactly those replies count."""
    if not LABELS.is_file():
        return None
    shown = {(_message(x["prompt"]), x[key]) for x in lines}
    labels = [x for x in json.loads(LABELS.read_text()).get(name, []) if (x["message"], x["reply"]) in shown]
    return labels or None


def _message(prompt: object) -> str:
    return prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _row(label: str, part: dict, labels: list | None) -> str:
    sim = part.get("eval/reward/similarity", part.get("eval/metric/similarity"))
    hand = f"{_mean([x['answers'] for x in labels]):.0%} ({len(labels)})" if labels else "-"
    return (f"| {label} | {hand} | {part['eval/metric/relevance:about_the_message']:.0%} | "
            f"{sim:.2f} | {part['eval_accuracy']:.0%} | {part['eval/reward/judge']:.2f} | "
            f"{part['eval/length_mean']:.0f} | {part['eval/truncated_frac']:.0%} | {part['review_share']:.0%} | "
            f"{part['eval/refusal_frac']:.0%} |")


def report(runs: dict[str, dict], steps: int) -> str:
    lines = ["## The judged task: mitigations measured by what the judge does not see (benchmarks/judged_task.py)", "",
             (f"`python benchmarks/judged_task.py --steps {steps}` on {describe()}: examples/judge.yaml per variant "
              "and seed, 40 steps of 4 messages x 8 replies against Gemma 3 270M (base, few-shot, P(warm)); greedy "
              "replies to the 60 held-out messages, base model vs trained adapter. Answers (hand): the share a person "
              "labelled as answering the message (docs/concepts/judge_labels.json); about the message: the share "
              "whose tokens the message makes at least 0.2 nats more likely under the untrained SmolLM2 "
              "(examples/relevance.py); similarity: reply vs message under all-MiniLM-L6-v2 (trained on by the recipe "
              "only); VADER+: clearly positive (compound >= 0.5); judge: the training judge's score; reviews: replies "
              "that review or rewrite the message (rlvr.rewards.format.REVIEW)."), "",
             ("| run | answers (hand) | about the message | similarity | VADER+ | judge | tokens | cut | reviews | "
              "refusals |"), "|---|---|---|---|---|---|---|---|---|---|"]
    first = next(iter(runs.values()))
    lines.append(_row("base model", first["eval"]["base"], hand_labels("base", first["replies"], "base_reply")))
    for name, run in runs.items():
        lines.append(_row(name, run["eval"], hand_labels(name, run["replies"], "reply")))
    lines += ["", "| run | gaming check (rlvr eval --against-base) | in the run (eval/gaming at steps 10-40) |",
              "|---|---|---|"]
    for name, run in runs.items():
        alarm = run["eval"].get("gaming")
        said = (f"fires: {alarm['reward']} {alarm['reward_then']:.2f} -> {alarm['reward_now']:.2f}, "
                f"{alarm['measure']} {alarm['measure_then']:.2f} -> {alarm['measure_now']:.2f}") if alarm else "quiet"
        inside = [e["eval/gaming"] for e in run["evals"] if "eval/gaming" in e]
        lines.append(f"| {name} | {said} | {' '.join(f'{v:.0f}' for v in inside) if inside else 'not logged'} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path) -> None:
    """Left: the judge's score of the sampled replies per step, per run; right: the held-out measures the judge does
    not see, base model and each run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    colours = {"unmitigated": "C3", "brevity": "C1", "maximise": "C2", "recipe": "C0"}
    for name, run in runs.items():
        left.plot([c["step"] for c in run["curve"]], [c["judge"] for c in run["curve"]], lw=1,
                  color=colours.get(name.rsplit("_s", 1)[0], "C0"), label=name)
    left.set(xlabel="step", ylabel="judge: P(warm) of the sampled replies", ylim=(0.3, 1.0))
    left.legend(fontsize=7)
    first = next(iter(runs.values()))

    def hand(labels: list | None) -> float:
        return _mean([x["answers"] for x in labels]) if labels else 0.0

    parts = [("base model", {**first["eval"]["base"],
                             "hand": hand(hand_labels("base", first["replies"], "base_reply"))})]
    parts += [(n, {**r["eval"], "hand": hand(hand_labels(n, r["replies"], "reply"))}) for n, r in runs.items()]
    keys = [("hand", "answers the message (hand labels)"),
            ("eval/metric/relevance:about_the_message", "about the message (SmolLM2)"),
            ("eval_accuracy", "VADER clearly positive"), ("review_share", "reviews the message")]
    width = 0.8 / len(keys)
    for k, (key, label) in enumerate(keys):
        right.bar([i + k * width for i in range(len(parts))], [p[key] for _, p in parts], width, label=label)
    right.set_xticks([i + 1.5 * width for i in range(len(parts))], [n for n, _ in parts], rotation=30, fontsize=7)
    right.set(ylabel="share of the 60 held-out replies", ylim=(0, 1.35))
    right.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["unmitigated", "brevity", "maximise", "recipe"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=Path, default=None, help="measure runs already trained in DIR/VARIANT_sSEED")
    parser.add_argument("--remeasure", action="store_true", help="measure again runs measured before")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    proc, url = start_judge()
    try:
        runs = {}
        where = args.runs or ROOT / "runs" / "judged_task"
        for name in args.variants:
            for seed in args.seeds:
                run = where / f"{name}_s{seed}"
                if args.runs is None:
                    started = time.perf_counter()
                    train(variant(name, seed, args.steps, url, run))
                    print(f"{run.name}: {(time.perf_counter() - started) / 60:.1f} min", flush=True)
                if (run / "adapter").is_dir():
                    runs[run.name] = measure(run, url, args.remeasure)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    markdown = report(runs, args.steps)
    plot(runs, ROOT / "docs" / "concepts" / "judged_task.png")
    markdown += "\n\n![judged task](docs/concepts/judged_task.png)"
    print(markdown)
    publish("judged_task", {"machine": describe(), "runs": runs}, markdown)


if __name__ == "__main__":
    main()
