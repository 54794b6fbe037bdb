"""The trainer-sampler log-prob gap per precision: how far the log-probs the sampler recorded are from the ones the
learner computes for the same tokens with the same weights, |logp_learner - logp_sampler| per trained token.

    python benchmarks/precision_gap.py --steps 4        # examples/demo.yaml, SmolLM2-135M-Instruct + LoRA

Each setting trains the demo in its own subprocess for ``--steps`` steps; reported per setting: the mean gap over
the steps (update/logp_gap, the mean over trained tokens) and the largest importance weight pi / pi_behav
(update/is_weight_max). Settings: fp32 weights decoded in fp32; fp32 weights decoded with bf16 copies (what
rollout.precision=auto picks on a CPU with bf16 units); a bf16 base with fp32 adapters (model.dtype=bf16, what auto
picks under LoRA on a bf16 GPU), sampler and learner both in bf16. On a GPU the kernels differ again (cuBLAS, SDPA
backends): run this script there (train.device=cuda) for that card's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from benchmarks.report import publish

SETTINGS = {
    "fp32 weights, fp32 decoding": ["model.dtype=fp32", "rollout.precision=fp32"],
    "fp32 weights, bf16 decoding copies": ["model.dtype=fp32", "rollout.precision=bf16"],
    "bf16 base + fp32 LoRA (model.dtype=bf16)": ["model.dtype=bf16"],
}


def _run(overrides: list[str], steps: int, device: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = ["examples/demo.yaml", f"train.steps={steps}", "task.eval_size=8", "eval.every=0",
                "log.progress=false", "log.plot=false", "log.trackers=[]", "log.samples=false",
                f"train.device={device}", f"output_dir={tmp}/run", *overrides]
        subprocess.run([sys.executable, "-m", "rlvr", "train", *args], cwd=ROOT, check=True, capture_output=True)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "update/logp_gap" in r]
    return {"logp_gap": statistics.fmean(r["update/logp_gap"] for r in steps_rows),
            "is_weight_max": max(r["update/is_weight_max"] for r in steps_rows),
            "reward": statistics.fmean(r["rollout/reward_mean"] for r in steps_rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-write-md", action="store_true", help="results JSON only, BENCHMARKS.md untouched")
    parser.add_argument("--only", type=int, nargs="*", help="indices of the settings to run (default: all)")
    args = parser.parse_args()
    results = {"machine": describe(), "device": args.device, "steps": args.steps, "settings": {}}
    for i, (name, overrides) in enumerate(SETTINGS.items()):
        if args.only and i not in args.only:
            continue
        results["settings"][name] = _run(overrides, args.steps, args.device)
        print(name, results["settings"][name], flush=True)
    command = f"python benchmarks/precision_gap.py --steps {args.steps} --device {args.device}"
    lines = ["## Trainer-sampler log-prob gap per precision (benchmarks/precision_gap.py)", "",
             (f"`{command}` on {results['machine']}: examples/demo.yaml (SmolLM2-135M-Instruct, LoRA r16 on all "
              "linear layers); mean over the steps of the mean |logp_learner - logp_sampler| per trained token, and "
              "the largest importance weight."), "",
             "| weights and decoding | mean gap (nats/token) | largest pi/pi_behav | reward |", "|---|---|---|---|"]
    for name, r in results["settings"].items():
        lines.append(f"| {name} | {r['logp_gap']:.2e} | {r['is_weight_max']:.3f} | {r['reward']:.3f} |")
    markdown = "\n".join(lines)
    print(markdown)
    if args.no_write_md:
        out = ROOT / "benchmarks" / "results"
        out.mkdir(exist_ok=True)
        (out / "precision_gap.json").write_text(json.dumps({**results, "markdown": markdown}, indent=2) + "\n")
    else:
        publish("precision_gap", results, markdown)


if __name__ == "__main__":
    main()
