"""Two learners that share rollouts against one learner at equal generated samples, on a sparse binary reward.

    python benchmarks/shared_rollouts.py run one --seed 1      # one learner, 8 prompts a step, on core 0
    python benchmarks/shared_rollouts.py run step --seed 1     # two learners, 4 prompts each (cores 0 and 1),
                                                               # rollouts=step: both train on the step's 8 groups
    python benchmarks/shared_rollouts.py run diloco --seed 1   # two learners, no sharing, plain averaging every 16
    python benchmarks/shared_rollouts.py run recent --seed 1   # own 4 groups + up to 4 of the peer's last 2 steps,
                                                               # plain averaging every 16 (SAPO-style)
    python benchmarks/shared_rollouts.py timing --steps 5      # step times on an idle machine: one learner on one
                                                               # core against two sharing learners on one core each
    python benchmarks/shared_rollouts.py report                # the tables, a plot, BENCHMARKS.md's section

examples/shared_rollouts.yaml's task (SmolLM2-135M-Instruct + LoRA r16, two-step word problems, math_correct only:
1 for the right final number, else 0), 48 steps; every process has one torch thread and is pinned to one core
(taskset), as a learner on a consumer machine with one core would be. Learner 0 evaluates both held-out sets every
16 steps; learner 1 only its stories at the end. Runs go to --root (default runs/shared-bench), one directory per arm
and seed; ``report`` reads every run there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from benchmarks.report import publish

EXAMPLE = "examples/shared_rollouts.yaml"
COMMON = ["train.threads=1", "rollout.per_completion_seeds=true", "log.progress=false", "log.plot=false",
          "log.trackers=[]", "log.samples=false", "train.checkpoint_every=0"]
ARMS = {  # arm -> (learners, overrides of every learner)
    "one": (1, ["train.prompts_per_step=8"]),
    "step": (2, ["diloco.rollouts=step", "diloco.inner_steps=0"]),
    "diloco": (2, ["diloco.rollouts=off", "diloco.inner_steps=16", "diloco.outer_lr=1.0", "diloco.outer_momentum=0"]),
    "recent": (2, ["diloco.rollouts=recent", "diloco.external_groups=4", "diloco.rollout_max_age=2",
                   "diloco.inner_steps=16", "diloco.outer_lr=1.0", "diloco.outer_momentum=0"]),
}
LABELS = {"one": "one learner, 8 prompts a step", "step": "2 learners, rollouts=step (train on both halves)",
          "diloco": "2 learners, weights only (H = 16, plain averaging)",
          "recent": "2 learners, rollouts=recent (4 own + up to 4 of the peer's), H = 16"}


def run(root: Path, arm: str, seed: int, extra_args: tuple[str, ...] = ()) -> None:
    learners, extra = ARMS[arm]
    extra = [*extra, *extra_args]
    out = root / f"{arm}-s{seed}"
    base = [sys.executable, "-m", "rlvr", "train", EXAMPLE, f"train.seed={seed}", *COMMON, *extra]
    if learners == 1:
        subprocess.run(["taskset", "-c", "0", *base, f"output_dir={out}/l0"], cwd=ROOT, check=True)
        return
    jobs = []
    for k in range(learners):
        quiet = [] if k == 0 else ["eval.every=0", "eval.extra_path="]  # the learners hold the same task rows
        jobs.append(subprocess.Popen(["taskset", "-c", str(k), *base, f"diloco.learner={k}/{learners}",
                                      f"diloco.bucket={out}/bucket", f"output_dir={out}/l{k}", "eval.on_start=false",
                                      *quiet], cwd=ROOT))
    if any(job.wait() for job in jobs):
        raise SystemExit(f"{arm} seed {seed}: a learner failed")


def timing(root: Path, steps: int) -> dict:
    """Median step, generation and update times (the first step left out) of `one` and `step`, each alone on the
    machine, without evaluation (task.eval_size=0: both learners then hold the same rows)."""
    out = {}
    for arm in ("one", "step"):
        run(root / "timing", arm, 1, ("task.eval_size=0", "eval.extra_path=", f"train.steps={steps}",
                                      "eval.on_start=false"))
        rows = [r for r in _rows(root / "timing" / f"{arm}-s1" / "l0") if "time/step_s" in r][1:]
        out[arm] = {k: statistics.median(r[m] for r in rows) for k, m in (
            ("step_s", "time/step_s"), ("generate_s", "rollout/time_generate_s"), ("update_s", "update/time_s"))}
        out[arm]["wait_s"] = statistics.median(r.get("shared/wait_s", 0.0) for r in rows)
    out["ratio"] = out["step"]["step_s"] / out["one"]["step_s"]
    out["generation_share"] = out["one"]["generate_s"] / out["one"]["step_s"]
    (root / "timing.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return out


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir: Path, learners: int) -> dict:
    """Learner 0's accuracy at each evaluation with the generated samples and wall time (its step times summed) so
    far; bytes each learner sent; the step's generation and update times (medians)."""
    rows = _rows(run_dir / "l0")
    wall, curve = 0.0, []
    for r in rows:
        wall += r.get("time/step_s", 0.0)
        if "eval/accuracy" in r and r["step"] > 0:
            curve.append({"step": r["step"], "samples": r["step"] * 64, "wall_s": round(wall, 1),
                          "stories": r["eval/accuracy"], "independent": r.get("eval/extra_accuracy")})
    last = rows[-1]
    sent = last.get("shared/total_bytes_sent", 0.0) + last.get("update/outer_bytes_sent", 0.0)
    steps = [r for r in rows if "rollout/time_generate_s" in r]
    adapter = (run_dir / "l0" / "adapter" / "adapter_model.safetensors").stat().st_size
    return {"curve": curve, "wall_s": round(wall, 1), "sent_bytes": sent, "adapter_bytes": adapter,
            "allreduce_bytes": adapter * len(steps) * 2 * (learners - 1) / learners if learners > 1 else 0,
            "generate_s": statistics.median(r["rollout/time_generate_s"] for r in steps),
            "update_s": statistics.median(r["update/time_s"] for r in steps),
            "wait_s": statistics.median(r.get("shared/wait_s", 0.0) for r in steps),
            "external_groups": last.get("shared/total_external_groups", 0.0),
            "mismatch": last.get("shared/total_reward_mismatch", 0.0), "refused": last.get("shared/total_refused", 0.0),
            "final": curve[-1] if curve else None}


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.mean(values)
    return f"{mean:.3f} ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else f"{mean:.3f}"


def report(root: Path) -> None:
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(root.glob("*-s*")):
        arm, seed = path.name.rsplit("-s", 1)
        if arm in ARMS and (path / "l0" / "summary.json").is_file():
            runs.setdefault(arm, {})[int(seed)] = summary(path, ARMS[arm][0])
    lines = [(f"`python benchmarks/shared_rollouts.py run ARM --seed S` for each arm and seed, then `... report`, on "
              f"{describe()}: examples/shared_rollouts.yaml (SmolLM2-135M-Instruct + LoRA r16, two-step word "
              "problems, a strictly binary reward: `math_correct`), 48 steps, 64 generated samples a step in every arm "
              "(one learner 8 prompts x 8; two learners 4 x 8 each), every process one thread pinned to one core. "
              "Accuracy is greedy on the 100 held-out stories / the 150 independent problems (0.06 / 0.013 before "
              "training); mean over the seeds (min-max). Wall: learner 0's step times summed, evaluations included; "
              "these runs shared the two cores with one another, so only the timing line below compares speed."), "",
             ("| arm | seeds | stories at 1,024 / 2,048 / 3,072 samples | independent at 3,072 | wall to 3,072 | "
              "bytes each learner sent | a per-step all-reduce |"), "|---|---|---|---|---|---|---|"]
    for arm, seeds in runs.items():
        def at(key: str, step: int, seeds: dict = seeds) -> list[float]:
            return [c[key] for s in seeds.values() for c in s["curve"] if c["step"] == step]

        stories = " / ".join(_spread(at("stories", st)) for st in (16, 32, 48))
        sent = statistics.mean(s["sent_bytes"] for s in seeds.values())
        allreduce = statistics.mean(s["allreduce_bytes"] for s in seeds.values())
        wall = statistics.mean(s["wall_s"] for s in seeds.values())
        traffic = f"{sent / 2**10:.0f} KiB | {allreduce / 2**20:.0f} MiB" if allreduce else "- | -"
        lines.append(f"| {LABELS[arm]} | {', '.join(map(str, sorted(seeds)))} | {stories} | "
                     f"{_spread(at('independent', 48))} | {wall / 60:.1f} min | {traffic} |")
    lines += ["", ("Per seed (stories / independent at 1,024, 2,048, 3,072 samples; learner 0's wall time; median "
                   "generation / update / wait of a step):"), ""]
    for arm, seeds in runs.items():
        for seed, s in sorted(seeds.items()):
            points = "; ".join(f"{c['stories']:.2f} / {c['independent']:.3f}" for c in s["curve"])
            lines.append(f"- {arm} seed {seed}: {points}; {s['wall_s'] / 60:.1f} min; {s['generate_s']:.1f} / "
                         f"{s['update_s']:.1f} / {s['wait_s']:.1f} s" + (
                             f"; {s['external_groups']:.0f} peer groups trained, {s['mismatch']:.0f} reward "
                             f"mismatches, {s['refused']:.0f} refused" if arm in ("step", "recent") else ""))
    timed = json.loads((root / "timing.json").read_text()) if (root / "timing.json").is_file() else None
    if timed:
        one, two = timed["one"], timed["step"]
        lines += ["", (
            "Step times on the idle machine (`... timing`; medians, the first step left out, no evaluation): one "
            f"learner on one core {one['step_s']:.1f} s (generation {one['generate_s']:.1f} s, update "
            f"{one['update_s']:.1f} s: generation {100 * timed['generation_share']:.0f} % of the step); two sharing "
            f"learners on one core each {two['step_s']:.1f} s (generation {two['generate_s']:.1f} s, update "
            f"{two['update_s']:.1f} s, waiting for the peer {two['wait_s']:.1f} s): {timed['ratio']:.2f}x the one "
            "learner's step (the two learners share one machine's memory bandwidth, and their trajectories drew "
            "more informative groups to update on).")]
        reach = time_to_reach(runs, one["step_s"], two["step_s"])
        if reach:
            lines += ["", reach]
    publish("shared_rollouts", {"machine": describe(), "timing": timed, "runs": {a: {str(k): v for k, v in s.items()}
                                                                for a, s in runs.items()}}, "\n".join(
        ["## Learners that share rollouts on a sparse reward (benchmarks/shared_rollouts.py)", "", *lines]))
    plot(runs)


def time_to_reach(runs: dict[str, dict[int, dict]], one_step_s: float, step_step_s: float) -> str:
    """The issue's wall-time measure: the first evaluation at which the sharing pair's mean accuracy (over seeds)
    reaches the one learner's final mean on both sets, in idle step times."""
    if "one" not in runs or "step" not in runs:
        return ""
    def mean(arm: str, key: str, step: int) -> float:
        return statistics.mean(c[key] for s in runs[arm].values() for c in s["curve"] if c["step"] == step)

    last = max(c["step"] for s in runs["one"].values() for c in s["curve"])
    target = {k: mean("one", k, last) for k in ("stories", "independent")}
    for step in sorted({c["step"] for s in runs["step"].values() for c in s["curve"]}):
        if all(mean("step", k, step) >= target[k] for k in target):
            ratio = step * step_step_s / (last * one_step_s)
            return (f"Wall time to the one learner's final mean accuracy ({target['stories']:.3f} / "
                    f"{target['independent']:.3f}, step {last}): the pair's mean reached it at its step-{step} "
                    f"evaluation, {step} x {step_step_s:.1f} s against {last} x {one_step_s:.1f} s in idle step "
                    f"times: {ratio:.2f}x (means of noisy evaluations: the per-step ratio above is the sturdier "
                    "number).")
    return "The pair's mean accuracy did not reach the one learner's final mean at any evaluation."


def plot(runs: dict[str, dict[int, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharex=True)
    for arm, seeds in runs.items():
        for ax, key in zip(axes, ("stories", "independent")):
            steps = sorted({c["step"] for s in seeds.values() for c in s["curve"]})
            means = [statistics.mean(c[key] for s in seeds.values() for c in s["curve"] if c["step"] == st)
                     for st in steps]
            line, = ax.plot([0, *[st * 64 for st in steps]], [0.06 if key == "stories" else 0.013, *means],
                            marker="o", label=LABELS[arm])
            for s in seeds.values():
                ax.scatter([c["samples"] for c in s["curve"]], [c[key] for c in s["curve"]], s=10,
                           color=line.get_color(), alpha=0.4)
    for ax, title in zip(axes, ("held-out stories", "independent problems")):
        ax.set_title(title)
        ax.set_xlabel("generated samples (all learners)")
        ax.set_ylabel("greedy accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "shared_rollouts.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("run", "timing", "report"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("arm", nargs="?", choices=tuple(ARMS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "shared-bench")
    args = parser.parse_args()
    if args.what == "run":
        if not args.arm:
            parser.error("run needs an arm: " + ", ".join(ARMS))
        run(args.root, args.arm, args.seed)
    elif args.what == "timing":
        timing(args.root, args.steps)
    else:
        report(args.root)


if __name__ == "__main__":
    main()
