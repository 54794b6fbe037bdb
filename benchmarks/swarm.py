"""A swarm on consumer machines: learners of unequal speed that come and go, sharing rollouts through one bucket,
against one learner at equal generated samples, on examples/shared_rollouts.yaml's task (a strictly binary reward).

    python benchmarks/swarm.py run one --seed 1                  # one learner, 8 prompts a step, 0.6 of a core
    python benchmarks/swarm.py run async --seed 1                # 4 slots, at most 3 alive: 2 fast, 1 slow, churn;
                                                                 # rollouts=recent, a weight round every 4 steps
    python benchmarks/swarm.py run step --seed 1                 # the same swarm, rollouts=step (waits for peers)
    python benchmarks/swarm.py run pair --seed 1                 # the two fast learners alone, rollouts=recent
    python benchmarks/swarm.py run async --seed 1 --store s3 --delay-ms 100   # the bucket on an S3 server behind
                                                                 # a link that adds 100 ms to every request
    python benchmarks/swarm.py storecost --delay-ms 100          # the store's cost per step, without training
    python benchmarks/swarm.py report                            # one table; BENCHMARKS.md's section

The machine has two cores; the learners get fixed CPU shares of them, as consumer machines of unequal speed would
have. cgroups are not writable here, so the shares are made the way cpulimit makes them: every learner is pinned to
one core (taskset) and time-sliced in 100 ms windows with SIGSTOP / SIGCONT (to its whole process group). Core 0:
learner 0 runs the first 60 % of each window, the slow learner 2 the next 20 % (never at the same time as learner
0); core 1: learner 1 runs 60 % of each window, and after learner 1 is killed its slot goes to the joiner, learner
3. Fast learners have 0.6 of a core, the slow one 0.2 (3x slower); the store server and this harness are not
pinned and use what is left (``--shares`` changes the fractions). Every learner has one torch thread; learner 1
multiplies fp32 through BLAS (RLVR_FP32_MATMUL=blas), the others through oneDNN: another CPU's arithmetic. A learner
is continued (SIGCONT) before it is stopped or killed, and whatever happens every learner is continued and ended
when the harness exits.

Arms: ``one`` runs samples / 64 steps of 8 prompts x 8 completions. The swarms run 4 prompts a step per learner;
learner 0 runs samples / 64 steps and the others run until it has sampled its last step (a median step time after
its next-to-last one; then SIGTERM, SIGKILL after a grace), so that learner 0 evaluates alone. In
``async`` and ``step`` learner 1 is SIGKILLed when learner 0 has done a third of its steps and a fresh joiner
(slot 3, diloco.join=true) starts at two thirds, so that the swarm generates about 32 x (S + S/3 + S/3 + S/3) =
64 S samples, the one learner's (each run records what its learners generated). Learner 0 evaluates both held-out
sets at its last step. Runs go to --root (default runs/swarm-bench), one directory per arm, store and seed, each with
swarm.json (what the report reads) and every learner's log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe
from benchmarks.report import publish

EXAMPLE = "examples/shared_rollouts.yaml"
COMMON = ["train.threads=1", "rollout.per_completion_seeds=true", "log.progress=false", "log.plot=false",
          "log.trackers=[]", "log.samples=false", "train.checkpoint_every=0", "eval.on_start=false"]
SMOKE = ["rollout.max_new_tokens=8", "task.eval_size=4", "eval.batch_size=4", "eval.extra_path="]
SWARM = ["train.prompts_per_step=4", "diloco.external_groups=8", "diloco.rollout_max_age=2", "diloco.outer_lr=1.0",
         "diloco.outer_momentum=0", "diloco.round_timeout_s=30"]


@dataclass(frozen=True)
class Arm:
    slots: int  # K of diloco.learner=k/K (1: no bucket at all)
    churn: bool  # a slow learner 2, learner 1 killed at 1/3, a joiner in slot 3 at 2/3
    overrides: tuple[str, ...]
    label: str


ARMS = {
    "one": Arm(1, False, ("train.prompts_per_step=8",), "one learner, 8 prompts a step"),
    "async": Arm(4, True, (*SWARM, "diloco.rollouts=recent", "diloco.inner_steps=4"),
                 "swarm, rollouts=recent, a weight round every 4 steps"),
    "step": Arm(4, True, (*SWARM, "diloco.rollouts=step", "diloco.rollout_timeout_s=60", "diloco.inner_steps=0"),
                "swarm, rollouts=step (waits for the peers' groups)"),
    "pair": Arm(2, False, (*SWARM, "diloco.rollouts=recent", "diloco.inner_steps=4"),
                "two fast learners alone, rollouts=recent, rounds of 4"),
}
SAMPLES_PER_STEP = 64  # the one learner's 8 prompts x 8 completions; learner 0 of a swarm runs as many steps
GRACE_S = 20.0  # after SIGTERM, before SIGKILL
WAIT_STALL_S = 1.0  # a step whose wait for peers' groups or a round exceeded this counts as a stall


# --------------------------------------------------------------------------------------------- CPU shares
@dataclass(frozen=True)
class Share:
    core: int
    start: float  # where in each window the learner starts running, as a fraction of the window
    length: float  # the fraction of the window it runs


def shares(fast0: float, fast1: float, slow: float) -> dict[int, Share]:
    """Learner -> its share: 0 and 2 one after the other on core 0, 1 (then the joiner 3) on core 1."""
    if not (0 < fast0 and 0 < slow and fast0 + slow <= 1 and 0 < fast1 <= 1):
        raise SystemExit(f"--shares {fast0},{fast1},{slow}: need fast0 + slow <= 1 (one core) and fast1 <= 1")
    return {0: Share(0, 0.0, fast0), 1: Share(1, 0.0, fast1), 2: Share(0, fast0, slow), 3: Share(1, 0.0, fast1)}


def _signal(process: subprocess.Popen, signum: int) -> None:
    """``signum`` to the learner's process group (it and anything it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


class TimeSlicer:
    """Runs each registered process group only during its share of every ``window_s`` window (SIGCONT at the start
    of its share, SIGSTOP at the end; at equal times stops before continues, so that two learners on one core never
    run together)."""

    def __init__(self, window_s: float = 0.1):
        self.window_s = window_s
        self.members: dict[int, tuple[subprocess.Popen, Share]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def add(self, process: subprocess.Popen, share: Share) -> None:
        with self._lock:
            self.members[process.pid] = (process, share)

    def release(self, process: subprocess.Popen) -> None:
        """No longer sliced; continued (left running)."""
        with self._lock:
            self.members.pop(process.pid, None)
        _signal(process, signal.SIGCONT)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            members = list(self.members.values())
            self.members.clear()
        for process, _ in members:
            _signal(process, signal.SIGCONT)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            with self._lock:
                live = [(p, s) for p, s in self.members.values() if p.poll() is None]
            events = sorted([(s.start, 1, p) for p, s in live] + [(s.start + s.length, 0, p) for p, s in live],
                            key=lambda e: (e[0], e[1]))
            for at, cont, process in events:
                delay = t0 + at * self.window_s - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    return
                with self._lock:
                    if process.pid not in self.members:  # released meanwhile: leave it running
                        continue
                    _signal(process, signal.SIGCONT if cont else signal.SIGSTOP)
            rest = t0 + self.window_s - time.monotonic()
            if rest > 0:
                self._stop.wait(rest)


# ------------------------------------------------------------------------------------------------ a run
class StoreServer:
    """``python -m tests.s3_server`` (moto behind a proxy that adds ``delay_ms`` to each request) as a subprocess."""

    def __init__(self, delay_ms: float, bytes_per_s: float):
        self.process = subprocess.Popen([sys.executable, "-m", "tests.s3_server", "--delay-ms", str(delay_ms),
                                         "--bytes-per-s", str(bytes_per_s)], cwd=ROOT, stdout=subprocess.PIPE,
                                        text=True, start_new_session=True)
        line = self.process.stdout.readline()
        if not line:
            self.stop()
            raise SystemExit("the S3 server did not start (python -m tests.s3_server; is moto[server] installed?)")
        info = json.loads(line)
        self.endpoint, self.bucket = info["endpoint"], info["bucket"]

    def environment(self, scratch: Path) -> dict[str, str]:
        """The AWS SDK's variables that point s3fs at the server (as tests/s3_server.py's s3_env sets them)."""
        env = {k: v for k, v in os.environ.items() if k not in (
            "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS")}
        env.update(AWS_ENDPOINT_URL_S3=self.endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                   AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=str(scratch / "no-aws-config"),
                   AWS_SHARED_CREDENTIALS_FILE=str(scratch / "no-aws-credentials"))
        return env

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # it stops moto (its own process group) itself
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                _signal(self.process, signal.SIGKILL)
                self.process.wait(timeout=10)


def _store_label(store: str, delay_ms: float, bytes_per_s: float) -> str:
    if store == "dir":
        return "dir"
    return f"s3-{delay_ms:g}ms" + (f"-{bytes_per_s / 1e6:g}MBps" if bytes_per_s else "")


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum('"time/step_s"' in line for line in path.read_text().splitlines())


def run(root: Path, arm_name: str, seed: int, store: str, delay_ms: float, bytes_per_s: float, samples: int,
        fractions: tuple[float, float, float], smoke: bool, extra: tuple[str, ...] = ()) -> Path:
    arm = ARMS[arm_name]
    label = _store_label(store, delay_ms, bytes_per_s) if arm.slots > 1 else "none"
    out = root / f"{arm_name}-{label}-s{seed}"
    if out.exists():
        raise SystemExit(f"{out} exists: remove it, or pick another --root or --seed")
    out.mkdir(parents=True)
    steps = max(samples // SAMPLES_PER_STEP, 1)
    share = shares(*fractions)
    base = [sys.executable, "-m", "rlvr", "train", EXAMPLE, f"train.seed={seed}", *COMMON, *arm.overrides,
            *(SMOKE if smoke else ()), *extra]
    server = StoreServer(delay_ms, bytes_per_s) if store == "s3" and arm.slots > 1 else None
    env = server.environment(out) if server else dict(os.environ)
    bucket = f"s3://{server.bucket}/swarm-{arm_name}-s{seed}" if server else str(out / "bucket")
    slicer = TimeSlicer()
    learners: dict[int, dict] = {}  # k -> {"process", "started", "ended", "end"}

    def start(k: int, joiner: bool = False) -> None:
        mine = [f"train.steps={steps}", f"eval.every={steps}"] if k == 0 else [
            f"train.steps={steps * 10}", "eval.every=0", "eval.extra_path="]
        if arm.slots > 1:
            mine += [f"diloco.learner={k}/{arm.slots}", f"diloco.bucket={bucket}"]
        mine += ["diloco.join=true"] if joiner else []
        command = ["taskset", "-c", str(share[k].core), *base, *mine, f"output_dir={out}/l{k}"]
        with open(out / f"l{k}.log", "w") as log:
            process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True,
                                       env={**env, "RLVR_FP32_MATMUL": "blas" if k == 1 else "onednn"})
        slicer.add(process, share[k])
        learners[k] = {"process": process, "started": time.monotonic(), "ended": None, "end": None,
                       "command": " ".join(command[3:])}

    def end(k: int, how: str) -> None:
        entry = learners[k]
        process = entry["process"]
        slicer.release(process)
        if process.poll() is None:
            if how == "killed":
                _signal(process, signal.SIGKILL)
            else:
                _signal(process, signal.SIGTERM)
                try:
                    process.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    how = "stopped, then killed after the grace"
                    _signal(process, signal.SIGKILL)
            process.wait()
        if entry["ended"] is None:
            entry["ended"], entry["end"] = time.monotonic(), how

    began = time.monotonic()
    last_step_began = None  # when learner 0 logged its next-to-last step: its last one, then its evaluation, began
    try:
        start(0)
        if arm.slots > 1:
            start(1)
        if arm.churn:
            start(2)
        while learners[0]["process"].poll() is None:
            done = _steps_done(out / "l0")
            if arm.churn and learners[1]["end"] is None and 3 * done >= steps:
                end(1, "killed")
            if arm.churn and 3 not in learners and 3 * done >= 2 * steps:
                start(3, joiner=True)
            if done >= steps - 1 and last_step_began is None:
                last_step_began = time.monotonic()
            timed = [r["time/step_s"] for r in _rows(out / "l0") if "time/step_s" in r]
            if last_step_began is not None and timed and time.monotonic() - last_step_began > statistics.median(
                    timed):  # learner 0's last step is sampled: the others stop, so the swarm's samples stay the
                for k, entry in learners.items():  # one learner's and learner 0 evaluates alone
                    if k and entry["ended"] is None:
                        end(k, "stopped when learner 0 finished sampling")
            for k, entry in learners.items():  # a learner that ended on its own
                if k and entry["ended"] is None and entry["process"].poll() is not None:
                    entry["ended"], entry["end"] = time.monotonic(), f"exited {entry['process'].returncode}"
            time.sleep(0.5)
        learners[0]["ended"], learners[0]["end"] = time.monotonic(), f"exited {learners[0]['process'].returncode}"
    finally:
        slicer.close()  # every learner continued
        for k in learners:
            if learners[k]["ended"] is None or learners[k]["process"].poll() is None:
                end(k, "stopped when learner 0 ended")
        if server:
            server.stop()
    result = {"arm": arm_name, "seed": seed, "store": label, "delay_ms": delay_ms if server else 0,
              "bytes_per_s": bytes_per_s if server else 0, "samples_asked": samples, "learner0_steps": steps,
              "shares": dict(zip(("fast0", "fast1", "slow"), fractions)), "smoke": smoke, "extra": list(extra),
              "machine": describe(), "wall_s": round(time.monotonic() - began, 1),
              "learner0_exit": learners[0]["process"].returncode,
              "learners": {str(k): {**learner_summary(out / f"l{k}"), "end": e["end"], "command": e["command"],
                                    "process_wall_s": round(e["ended"] - e["started"], 1)}
                           for k, e in sorted(learners.items())}}
    ls = result["learners"].values()
    result["totals"] = {key: sum(s[key] for s in ls) for key in (
        "steps", "generated_samples", "bytes_sent", "bytes_received", "stalls", "wait_s")}
    (out / "swarm.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "learners"}, indent=2))
    if learners[0]["process"].returncode:
        raise SystemExit(f"learner 0 failed (exit {learners[0]['process'].returncode}): see {out}/l0.log")
    return out


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut by SIGKILL
            rows.append(json.loads(line))
    return rows


def _group_size(run_dir: Path) -> int:
    import yaml

    config = run_dir / "config.yaml"
    return int(yaml.safe_load(config.read_text())["rollout"]["group_size"]) if config.is_file() else 8


def learner_summary(run_dir: Path) -> dict:
    """One learner's run from its metrics.jsonl: steps, generated samples (rollout/groups_sampled x G), step times,
    the waits (shared/wait_s for peers' groups, update/outer_wait_s for a round), bytes (shared/total_bytes_*,
    update/outer_bytes_sent; a round's received deltas are estimated: (update/outer_learners - 1) x
    update/outer_round_sent_bytes), outer rounds and late rounds, and its last evaluation."""
    rows = [r for r in _rows(run_dir) if "time/step_s" in r]
    if not rows:
        return {"steps": 0, "generated_samples": 0, "bytes_sent": 0.0, "bytes_received": 0.0, "stalls": 0,
                "wait_s": 0.0}
    G, last = _group_size(run_dir), rows[-1]
    timed = [r["time/step_s"] for r in rows[1:] if "eval/accuracy" not in r] or [rows[0]["time/step_s"]]
    shared_wait = [r.get("shared/wait_s", 0.0) for r in rows]
    outer_wait = [r.get("update/outer_wait_s", 0.0) for r in rows]
    received_deltas = sum(max(r.get("update/outer_learners", 1.0) - 1, 0) * r.get("update/outer_round_sent_bytes", 0)
                          for r in rows)
    evals = [r for r in rows if "eval/accuracy" in r]
    return {
        "steps": len(rows), "generated_samples": int(sum(r.get("rollout/groups_sampled", 0) for r in rows) * G),
        "step_median_s": round(statistics.median(timed), 2),
        "steps_wall_s": round(sum(r["time/step_s"] for r in rows), 1),
        "wait_s": round(sum(shared_wait) + sum(outer_wait), 1), "shared_wait_s": round(sum(shared_wait), 1),
        "outer_wait_s": round(sum(outer_wait), 1),
        "stalls": sum(a > WAIT_STALL_S or b > WAIT_STALL_S for a, b in zip(shared_wait, outer_wait)),
        "shared_bytes_sent": last.get("shared/total_bytes_sent", 0.0),
        "shared_bytes_received": last.get("shared/total_bytes_received", 0.0),
        "outer_bytes_sent": last.get("update/outer_bytes_sent", 0.0), "outer_bytes_received_est": received_deltas,
        "bytes_sent": last.get("shared/total_bytes_sent", 0.0) + last.get("update/outer_bytes_sent", 0.0),
        "bytes_received": last.get("shared/total_bytes_received", 0.0) + received_deltas,
        "external_groups": last.get("shared/total_external_groups", 0.0),
        "refused": last.get("shared/total_refused", 0.0) + last.get("update/outer_refused", 0.0),
        "outer_rounds": last.get("update/outer_rounds", 0.0), "outer_late": last.get("update/outer_late", 0.0),
        "snapshots": last.get("update/outer_snapshots", 0.0), "stale": last.get("shared/total_stale", 0.0),
        "reward_mismatch": last.get("shared/total_reward_mismatch", 0.0),
        "stories": evals[-1]["eval/accuracy"] if evals else None,
        "independent": evals[-1].get("eval/extra_accuracy") if evals else None,
    }


# ---------------------------------------------------------------------------------------------- the report
def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = fmt.format(statistics.mean(values))
    return f"{mean} ({fmt.format(min(values))}-{fmt.format(max(values))})" if len(values) > 1 else mean


def _bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def report(root: Path, write: bool = True) -> None:
    found = [json.loads(p.read_text()) for p in sorted(root.glob("*/swarm.json"))]
    runs = [r for r in found if r.get("learner0_exit") == 0]  # a run whose learner 0 failed is left out (said)
    failed = [f"{r['arm']} {r['store']} seed {r['seed']}" for r in found if r.get("learner0_exit") != 0]
    if not runs:
        raise SystemExit(f"no runs in {root} (python benchmarks/swarm.py run ARM --seed S)")

    def timing_only(r: dict) -> bool:  # held-out sets cut to a few rows: the run measured time, not accuracy
        return any(e.startswith("task.eval_size=") for e in r.get("extra", []))

    def cells(r: dict) -> list[str]:
        l0, t = r["learners"]["0"], r["totals"]
        if timing_only(r):
            return ["- (timing arm)", "-", f"{t['generated_samples']:,}", f"{r['wall_s'] / 60:.1f} min",
                    f"{_bytes(t['bytes_sent'])} / {_bytes(t['bytes_received'])}",
                    f"{t['stalls']} ({t['wait_s']:.0f} s)"]
        return [_spread([l0["stories"]]), _spread([l0["independent"]]), f"{t['generated_samples']:,}",
                f"{r['wall_s'] / 60:.1f} min", f"{_bytes(t['bytes_sent'])} / {_bytes(t['bytes_received'])}",
                f"{t['stalls']} ({t['wait_s']:.0f} s)"]

    machines = sorted({r["machine"] for r in runs})
    lines = [(f"`python benchmarks/swarm.py run ARM --seed S [--store s3 --delay-ms 100]`, then `... report`, on "
              f"{'; '.join(machines)}: examples/shared_rollouts.yaml (SmolLM2-135M-Instruct + LoRA r16, two-step "
              "word problems, `math_correct` only). Each learner one thread pinned to a core and time-sliced "
              "(SIGSTOP/SIGCONT, 100 ms windows) to a fixed share: fast learners 0.6 of a core, the slow one 0.2. "
              "Swarm arms: 4 slots, learner 1 (BLAS arithmetic) killed at a third of learner 0's steps, a joiner at "
              "two thirds. Accuracy: learner 0's greedy accuracy at its last step on the held-out stories / the "
              "independent problems. Samples: generated by all learners. Wall: the run's. Bytes: sent / received by "
              "all learners (received rounds estimated). Stalls: steps that waited over 1 s for peers' groups or a "
              "round (the waits summed)."), "",
             "| arm | store | seed | stories | independent | samples | wall | bytes | stalls |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (list(ARMS).index(r["arm"]), r["store"], r["seed"])):
        lines.append(f"| {r['arm']}{' (smoke)' if r['smoke'] else ''} | {r['store']} | {r['seed']} | "
                     + " | ".join(cells(r)) + " |")
    lines += ["", "Mean (min-max) over seeds:", "",
              "| arm | store | seeds | stories | independent | samples | wall (min) | stalls |",
              "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str, bool], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["arm"], r["store"], r["smoke"]), []).append(r)
    for (arm, store, smoke), rs in sorted(groups.items(), key=lambda g: (list(ARMS).index(g[0][0]), g[0][1])):
        lines.append(f"| {ARMS[arm].label}{' (smoke)' if smoke else ''} | {store} | "
                     f"{', '.join(str(r['seed']) for r in sorted(rs, key=lambda r: r['seed']))} | "
                     f"{_spread([r['learners']['0']['stories'] for r in rs if not timing_only(r)])} | "
                     f"{_spread([r['learners']['0']['independent'] for r in rs if not timing_only(r)])} | "
                     f"{_spread([r['totals']['generated_samples'] for r in rs], '{:,.0f}')} | "
                     f"{_spread([r['wall_s'] / 60 for r in rs], '{:.1f}')} | "
                     f"{_spread([r['totals']['stalls'] for r in rs], '{:.1f}')} |")
    one = _one_learner_reference(runs)
    if one:
        lines += ["", one]
    lines += ["", ("Each learner (recomputed from its metrics.jsonl): steps, median step time, peers' groups trained, "
              "rounds closed / late, snapshots taken, groups skipped as stale, refused files, how it ended:"), "",
              ("| arm | seed | learner | steps | median step | peers' groups | rounds / late | snapshots | stale | "
              "refused | ended |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (list(ARMS).index(r["arm"]), r["store"], r["seed"])):
        run_dir = root / f"{r['arm']}-{r['store']}-s{r['seed']}"
        for k, stored in sorted(r["learners"].items()):
            m = learner_summary(run_dir / f"l{k}") if (run_dir / f"l{k}").is_dir() else stored
            if not m.get("steps"):
                continue
            lines.append(f"| {r['arm']} | {r['seed']} | {k}{' (slow)' if k == '2' and ARMS[r['arm']].churn else ''} | "
                         f"{m['steps']} | {m['step_median_s']:.1f} s | {m['external_groups']:.0f} | "
                         f"{m['outer_rounds']:.0f} / {m['outer_late']:.0f} | {m.get('snapshots', 0):.0f} | "
                         f"{m.get('stale', 0):.0f} | {m['refused']:.0f} | {stored.get('end', '')} |")
    if failed:
        lines += ["", "Left out, learner 0 failed: " + "; ".join(failed) + "."]
    cost = root / "storecost.json"
    if cost.is_file():
        c = json.loads(cost.read_text())
        lines += ["", (f"The store's cost per step without training (`... storecost --delay-ms {c['delay_ms']:g}`): "
                       f"{c['dir']['per_step_s']:.3f} s on a directory, {c['s3']['per_step_s']:.3f} s on the S3 "
                       f"server at {c['delay_ms']:g} ms a request, against a {c['step_s']:.1f} s step: "
                       f"{100 * c['s3']['per_step_s'] / c['step_s']:.1f} % of it.")]
    print("\n".join(lines))
    if write:
        publish("swarm", {"runs": runs}, "\n".join(
            ["## A swarm on consumer machines (benchmarks/swarm.py)", "", *lines]))


def _one_learner_reference(runs: list[dict]) -> str:
    """The one learner at the swarms' sample count from benchmarks/shared_rollouts.py's three seeds (the same config,
    measured on the machine its results name), when this root has no ``one`` run of its own."""
    path = ROOT / "benchmarks" / "results" / "shared_rollouts.json"
    if any(r["arm"] == "one" for r in runs) or not path.is_file():
        return ""
    data = json.loads(path.read_text())
    samples = sorted({r["learner0_steps"] * SAMPLES_PER_STEP for r in runs if r["arm"] == "async"})
    rows = []
    for n in samples:
        points = [p for seed in data["runs"].get("one", {}).values() for p in seed["curve"] if p["samples"] == n]
        if points:
            rows.append(f"at {n:,} samples, {len(points)} seeds: stories {_spread([p['stories'] for p in points])}, "
                        f"independent {_spread([p['independent'] for p in points])}")
    if not rows:
        return ""
    return ("One learner (8 prompts a step, one core; benchmarks/shared_rollouts.py `run one`, the same config, "
            f"on {data['machine']}): " + "; ".join(rows) + ". Before training: 0.06 / 0.013.")


# ------------------------------------------------------------------------------------- the store's own cost
LORA_R, HIDDEN, KV, MLP, LAYERS = 16, 576, 192, 1536, 30  # SmolLM2-135M, LoRA r16 on its seven projections


def adapter_like() -> dict:
    """The trainable tensors of SmolLM2-135M's LoRA r16 adapter (4.9 M fp32: 19.5 MB), zeros."""
    import torch

    dims = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (HIDDEN, HIDDEN),
            "gate_proj": (HIDDEN, MLP), "up_proj": (HIDDEN, MLP), "down_proj": (MLP, HIDDEN)}
    like = {}
    for layer in range(LAYERS):
        for name, (d_in, d_out) in dims.items():
            prefix = f"model.layers.{layer}.{name}"
            like[f"{prefix}.lora_A.weight"] = torch.zeros(LORA_R, d_in)
            like[f"{prefix}.lora_B.weight"] = torch.zeros(d_out, LORA_R)
    return like


def _time_store(url: str, repeats: int, inner_steps: int) -> dict:
    """Median seconds of one learner's bucket work per step under rollouts=recent with 2 peers, as SharingSource does
    it: its step's groups published (2 informative groups of 8 x 64 tokens) while each peer is listed and its newest
    step read, all at once (threads); and of one weight round through DilocoUpdate's own code with every learner's
    delta there: publish the delta, decide (who arrived, their digests, the decision written and read back), the
    outer step (each pinned delta's verdict and bytes), the attestation and the shared weights (the decider's)."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    import torch

    from rlvr.config.loading import load_config
    from rlvr.run.diloco import DilocoUpdate
    from rlvr.store.rounds import RoundBucket
    from rlvr.store.shared_groups import GroupBucket, GroupLimits, NotPublished, SharedGroups
    from rlvr.store.snapshots import attest

    G, B, T, K = 8, 2, 64, 3
    limits = GroupLimits(max_groups=8, group_size=G, max_tokens=T, vocab=49152, rows=10_000)

    def groups(k: int, step: int) -> SharedGroups:
        gen = torch.Generator().manual_seed(step * K + k)
        return SharedGroups(k, step, step, G, row_ids=torch.tensor([k, k + K], dtype=torch.int64),
                            completion_ids=torch.randint(0, 49152, (B * G, T), generator=gen, dtype=torch.int32),
                            lengths=torch.full((B * G,), T, dtype=torch.int32),
                            behaviour_logp=-torch.rand(B * G, T, generator=gen),
                            rewards=torch.tensor([1.0, 0.0] * (B * G // 2)))

    buckets = [GroupBucket(url, k, K) for k in range(K)]

    def newest(k: int) -> int:
        steps = buckets[0].published(k)
        try:
            return buckets[0].read(k, steps[-1], limits)[1]
        except NotPublished:
            return 0

    step_times, sizes = [], []
    with ThreadPoolExecutor(max_workers=K) as pool:
        for step in range(1, repeats + 1):
            for k in (1, 2):
                buckets[k].publish(groups(k, step))
            started = time.monotonic()
            sending = pool.submit(buckets[0].publish, groups(0, step))
            list(pool.map(newest, (1, 2)))
            sizes.append(sending.result())
            step_times.append(time.monotonic() - started)
    like = adapter_like()
    delta = {name: torch.randn(t.shape) * 1e-3 for name, t in like.items()}
    start = {name: torch.randn(t.shape) * 1e-2 for name, t in like.items()}
    cfg = load_config(None, [f"diloco.learner=0/{K}", f"diloco.bucket={url}", "diloco.outer_lr=1.0",
                             "diloco.outer_momentum=0"])
    learner = DilocoUpdate(SimpleNamespace(needs_reference=False), cfg)
    rounds = [RoundBucket(url, k, K) for k in range(K)]
    round_times = []
    for round_ in range(1, max(repeats // 2, 2) + 1):
        for k in (1, 2):
            rounds[k].publish_delta(round_, delta, {})
        started = time.monotonic()
        delta_bytes = rounds[0].publish_delta(round_, delta, {})
        decision = learner._wait_for_decision(round_, like)
        weights, momentum, _, _ = learner._outer_step(round_, decision, start, None, like)
        attest(rounds[0], round_, weights, momentum)
        rounds[0].publish_state(round_, weights, momentum, {"members": list(decision.members)})
        round_times.append(time.monotonic() - started)
    step_s, round_s = statistics.median(step_times), statistics.median(round_times)
    return {"step_s": round(step_s, 4), "round_s": round(round_s, 4), "group_bytes": statistics.median(sizes),
            "delta_bytes": delta_bytes, "per_step_s": round(step_s + round_s / inner_steps, 4)}


def storecost(root: Path, delay_ms: float, bytes_per_s: float, step_s: float | None, repeats: int) -> dict:
    if step_s is None:
        runs = [json.loads(p.read_text()) for p in sorted(root.glob("async-*/swarm.json"))]
        runs = [r for r in runs if r.get("learner0_exit") == 0 and "step_median_s" in r["learners"]["0"]]
        real = [r for r in runs if not r["smoke"]]  # a real run's step time, where there is one
        found = [r["learners"]["0"]["step_median_s"] for r in real or runs]
        if not found:
            raise SystemExit(f"no async run in {root} to take learner 0's step time from: pass --step-s")
        step_s = statistics.median(found)
    inner_steps = 4
    with tempfile.TemporaryDirectory() as scratch:
        result = {"dir": _time_store(str(Path(scratch) / "bucket"), repeats, inner_steps)}
        server = StoreServer(delay_ms, bytes_per_s)
        try:
            os.environ.update(server.environment(Path(scratch)))
            result["s3"] = _time_store(f"s3://{server.bucket}/storecost", repeats, inner_steps)
        finally:
            server.stop()
    result.update(delay_ms=delay_ms, bytes_per_s=bytes_per_s, step_s=step_s, inner_steps=inner_steps,
                  machine=describe())
    for store in ("dir", "s3"):
        result[store]["share_of_step"] = round(result[store]["per_step_s"] / step_s, 4)
    root.mkdir(parents=True, exist_ok=True)
    (root / "storecost.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    local, remote = result["dir"]["per_step_s"], result["s3"]["per_step_s"]
    print(f"per step: directory {local:.3f} s, S3 at {delay_ms:g} ms {remote:.3f} s ({remote / max(local, 1e-9):.0f}x);"
          f" against a {step_s:.1f} s step: {100 * remote / step_s:.1f} % (directory {100 * local / step_s:.2f} %)")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("run", "report", "storecost"))
    parser.add_argument("arm", nargs="?", choices=tuple(ARMS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "swarm-bench")
    parser.add_argument("--store", choices=("dir", "s3"), default="dir")
    parser.add_argument("--delay-ms", type=float, default=100.0, help="s3: added to every request's round trip")
    parser.add_argument("--bytes-per-s", type=float, default=0.0, help="s3: each request's link speed (0: no cap)")
    parser.add_argument("--samples", type=int, default=1024, help="the one learner's generated samples")
    parser.add_argument("--shares", default="0.6,0.6,0.2", help="fast learner 0, fast learner 1 / 3, slow learner 2")
    parser.add_argument("--smoke", action="store_true", help="8-token completions, 4 held-out rows, no extra set")
    parser.add_argument("--step-s", type=float, default=None, help="storecost: the step time to compare with")
    parser.add_argument("--repeats", type=int, default=5, help="storecost: steps timed")
    parser.add_argument("--no-publish", action="store_true", help="report: print only (BENCHMARKS.md untouched)")
    parser.add_argument("overrides", nargs="*", default=[], help="run: more key=value overrides for every learner")
    args = parser.parse_intermixed_args()
    if args.what == "run":
        if not args.arm:
            parser.error("run needs an arm: " + ", ".join(ARMS))
        fractions = tuple(float(x) for x in args.shares.split(","))
        if len(fractions) != 3:
            parser.error("--shares takes three fractions: fast0,fast1,slow")
        run(args.root, args.arm, args.seed, args.store, args.delay_ms, args.bytes_per_s, args.samples, fractions,
            args.smoke, tuple(args.overrides))
    elif args.what == "report":
        report(args.root, not args.no_publish)
    else:
        storecost(args.root, args.delay_ms, args.bytes_per_s, args.step_s, args.repeats)


if __name__ == "__main__":
    main()
