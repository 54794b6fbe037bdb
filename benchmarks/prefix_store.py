"""What `rlvr serve`'s prefix store costs: the peak resident memory a batch adds, with the store off, at 1 MB and at
its default (1024 MB), for GRPO groups (4 requests of one prompt x n=8, as rlvr's pool sends them) and for episode
turns (32 requests of one completion of token ids: what the store is for).

    python benchmarks/prefix_store.py [--before REV]   # writes results/prefix_store.json + BENCHMARKS.md

Each configuration is one `rlvr serve` process (SmolLM2-135M-Instruct, fp32, 2 threads) on loopback; the peak
(VmHWM) is reset before each workload (/proc/PID/clear_refs), so a row is what that workload added over the server
at rest. ``--before REV`` runs the same servers from a checkout of REV too (a git worktree), side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STORES_MB = (0, 1, 1024)
TOKENS = 32


def _peak_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def _serve(code: Path, store_mb: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rlvr", "serve", "smollm2-135m-instruct", "--port", "0", "--threads", "2",
           "--prefix-cache-mb", str(store_mb), "--max-num-seqs", "64"]
    proc = subprocess.Popen(cmd, cwd=code, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(code)})
    for line in proc.stdout:
        if "listening on" in line or "Uvicorn running on" in line:
            url = line.split("http://", 1)[1].split()[0].rstrip("/)")
            break
    else:
        raise RuntimeError("the server did not start")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drained: never blocks it
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://{url}/health", timeout=5).status_code == 200:
                return proc, f"http://{url}"
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            os.killpg(proc.pid, 9)
            raise RuntimeError("the server never became ready")
        time.sleep(0.5)


def _workload(url: str, pid: int, prompts: list[list[int]], n: int) -> dict:
    """Peak RSS the requests add over the server at rest (MB), their wall time, and what they added to the store."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := current RSS
    rest = _peak_mb(pid)
    before = httpx.get(f"{url}/stats", timeout=10).json().get("prefix_cache_bytes", 0)
    body = {"max_tokens": TOKENS, "temperature": 1.0, "n": n, "return_token_ids": True}
    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", json={**body, "prompt": p, "seed": 1},
                                                     timeout=600), prompts))
    wall = time.perf_counter() - started
    assert all(a.status_code == 200 for a in answers), answers[0].text
    held = httpx.get(f"{url}/stats", timeout=10).json().get("prefix_cache_bytes", 0) - before
    return {"added_mb": round(_peak_mb(pid) - rest, 1), "wall_s": round(wall, 2), "held_mb": round(held / 2**20, 2)}


def measure(code: Path) -> dict:
    from rlvr.models.policy import load_tokenizer, resolve_model_dir
    from rlvr.models.prompts import prompt_token_ids
    from rlvr.tasks import arithmetic_rows

    tok = load_tokenizer(resolve_model_dir("smollm2-135m-instruct"))
    rows, _ = arithmetic_rows(1, ("+", "*"), eval_size=100, train_size=0, seed=1234, system_prompt="Reply briefly.")
    ids = [prompt_token_ids(tok, r["prompt"]) for r in rows[:32]]
    out = {}
    for store in STORES_MB:
        proc, url = _serve(code, store)
        try:
            _workload(url, proc.pid, ids[:1], 1)  # warm-up
            out[f"store {store} MB"] = {"groups (4 x n=8)": _workload(url, proc.pid, ids[:4], 8),
                                        "turns (32 x n=1)": _workload(url, proc.pid, ids[:32], 1)}
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
    return out


def markdown(results: dict) -> str:
    codes = list(results["runs"])
    lines = ["| server | store | groups: peak added / held / wall | turns: peak added / held / wall |",
             "|---|---|---|---|"]
    for code in codes:
        for store, rows in results["runs"][code].items():
            g, t = rows["groups (4 x n=8)"], rows["turns (32 x n=1)"]
            lines.append(f"| {code} | {store} | {g['added_mb']} MB / {g['held_mb']} MB / {g['wall_s']} s | "
                         f"{t['added_mb']} MB / {t['held_mb']} MB / {t['wall_s']} s |")
    title = ("## `rlvr serve`'s prefix store: what a batch adds to the peak (`python benchmarks/prefix_store.py "
             f"--before {results.get('before') or 'REV'}`)")
    about = (f"SmolLM2-135M-Instruct fp32, 2 threads, {TOKENS} new tokens; groups: 4 concurrent requests of one "
             "prompt x n=8 (as rlvr's pool sends GRPO groups); turns: 32 concurrent requests of one completion of "
             "token ids (episode turns, what the store is for). Peak = VmHWM reset before each workload: what it "
             "adds over the server at rest, the allocator's retention included; held = what it added to the store. "
             f"One `rlvr serve` per row, measured side by side in one run. Machine: {results['machine']}.")
    return "\n".join(["<!-- prefix_store:start -->", title, "", about, "", *lines, "", "<!-- prefix_store:end -->"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="", help="a git revision to measure side by side (a worktree of it)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefix_store.json")
    args = parser.parse_args()
    codes = {"HEAD": ROOT}
    worktree = None
    if args.before:
        worktree = Path(tempfile.mkdtemp(prefix="rlvr-before-"))
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        codes = {args.before: worktree, **codes}
    try:
        runs = {name: measure(code) for name, code in codes.items()}
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, check=False)
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "runs": runs,
               "before": args.before}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    section = markdown(results)
    bench = ROOT / "BENCHMARKS.md"
    text = bench.read_text()
    if "<!-- prefix_store:start -->" in text:
        head, rest = text.split("<!-- prefix_store:start -->", 1)
        text = head + section + rest.split("<!-- prefix_store:end -->", 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    bench.write_text(text)
    print(section)


if __name__ == "__main__":
    main()
