"""A refactor against the code it replaced: same config, same seeds, old and new code run alternately.

    python benchmarks/loop_ab.py --base 9c0969d --rounds 2 --steps 20      # the step refactor (issue 34)
    python benchmarks/loop_ab.py --base 6293449 --rounds 3 --steps 4       # the one-loop refactor

The old code is checked out with ``git worktree`` at ``--base`` and imported instead of this tree (PYTHONPATH).
Both train examples/demo.yaml (SmolLM2-135M-Instruct + LoRA) for ``--steps`` steps. Reported: whether every
per-step value (reward, loss, KL, gradient norm, entropy) is identical - the refactor must not change a single
number - and the median update time and step time of each side, as a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from benchmarks.report import publish
from rlvr.store.metrics import ACCURACY

# old name -> new name of the values compared
SAME = {"reward_mean": "rollout/reward_mean", "loss": "update/loss", "kl": "update/kl",
        "grad_norm": "update/grad_norm", "entropy": "update/entropy"}
OLD_TIME = ("time_generate_s", "time_reward_s", "time_train_s", "time_sync_s")
NEW_TIME = ("rollout/time_generate_s", "rollout/time_reward_s", "update/time_s", "sampler/time_s")


def _train(code: Path, out: Path, steps: int, eval_size: int = 8) -> list[dict]:
    overrides = [f"train.steps={steps}", f"task.eval_size={eval_size}", "eval.every=0", "log.progress=false",
                 "log.plot=false", "log.trackers=[]", "log.samples=false", "train.threads=2", f"output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(code)}
    probe = subprocess.run([sys.executable, "-c", "import rlvr; print(rlvr.__file__)"], env=env, cwd=code,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert probe.startswith(str(code)), f"imported {probe}, not the code under {code}"
    subprocess.run([sys.executable, "-m", "rlvr", "train", "examples/demo.yaml", *overrides], env=env, cwd=code,
                   check=True, capture_output=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows[1]["eval/accuracy_before"] = rows[0].get("eval/accuracy", rows[0].get("eval_accuracy"))
    return rows[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="9c0969d", help="the commit before the refactor")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--new", default="", help="a commit to compare instead of this working tree")
    parser.add_argument("--eval-size", type=int, default=8, help="held-out questions evaluated before and after")
    parser.add_argument("--section", default="loop_ab", help="the BENCHMARKS.md section (and results file) written")
    parser.add_argument("--title", default="A refactor against the code it replaced")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_code = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old_code), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        new_code = ROOT
        if args.new:
            new_code = Path(tmp) / "new"
            subprocess.run(["git", "worktree", "add", "--detach", str(new_code), args.new], cwd=ROOT, check=True,
                           capture_output=True)
        try:
            runs: dict[str, list[list[dict]]] = {"old": [], "new": []}
            for k in range(args.rounds):
                for side, code in (("old", old_code), ("new", new_code)):
                    runs[side].append(_train(code, Path(tmp) / f"{side}-{k}", args.steps, args.eval_size))
                    print(f"round {k + 1}/{args.rounds}: {side} done", flush=True)
        finally:
            for code in {old_code, new_code} - {ROOT}:
                subprocess.run(["git", "worktree", "remove", "--force", str(code)], cwd=ROOT, check=False)
    old, new = runs["old"][0], runs["new"][0]
    identical = len(old) == len(new) and all(o.get(a, o.get(b)) == n.get(b) for o, n in zip(old, new)
                                             for a, b in SAME.items())
    identical &= all(o.get(k) == n.get(k) for o, n in zip(old, new) for k in ("eval/accuracy_before", ACCURACY))
    held_out = {side: statistics.median(r["eval/time_s"] for run in runs[side] for r in run if "eval/time_s" in r)
                for side in runs}  # greedy generation over the held-out questions, after the last step
    update = {side: statistics.median(r.get("time_train_s", r.get("update/time_s"))
                                      for run in runs[side] for r in run[1:]) for side in runs}  # step 1 warms up
    step = {side: statistics.median(sum(r[k] for k in (OLD_TIME if "time_train_s" in r else NEW_TIME))
                                    for run in runs[side] for r in run[1:]) for side in runs}
    results = {"base": args.base, "rounds": args.rounds, "steps": args.steps, "identical_values": identical,
               "update_s": update, "step_s": step, "update_ratio": update["new"] / update["old"],
               "held_out_eval_s": held_out,
               "step_ratio": step["new"] / step["old"], "machine": describe()}
    markdown = f"""## {args.title} (old vs new code, same run)

`examples/demo.yaml` (SmolLM2-135M-Instruct + LoRA), {args.steps} steps, old ({args.base}) and new code run
alternately {args.rounds} times; medians over steps 2..{args.steps} of every run.

| | old code | new code | new / old |
|---|---|---|---|
| update (train step) | {update['old']:.2f} s | {update['new']:.2f} s | {results['update_ratio']:.3f} |
| step (generate + score + update + sync) | {step['old']:.2f} s | {step['new']:.2f} s | {results['step_ratio']:.3f} |
| held-out evaluation ({args.eval_size} questions, greedy) | {held_out['old']:.2f} s | {held_out['new']:.2f} s | \
{held_out['new'] / held_out['old']:.3f} |

Every per-step value (reward, loss, KL, gradient norm, entropy) and the held-out accuracy before and after identical:
**{'yes' if identical else 'NO'}**.

Command: `python benchmarks/loop_ab.py --base {args.base} --rounds {args.rounds} --steps {args.steps} --eval-size \
{args.eval_size} --section {args.section}`;
machine: {results['machine']}."""
    publish(args.section, results, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
