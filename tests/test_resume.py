"""Exact resume: SIGKILL at several points, resume=auto, and the run matches an uninterrupted one bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlvr.config.loading import load_config
from rlvr.launch import train

ROOT = Path(__file__).resolve().parent.parent
VOLATILE = ("time", "_per_s")  # wall-clock figures


def _overrides(model_dir, out, lora):
    return [
        f"model.name={model_dir}", f"model.lora={str(lora).lower()}", "model.lora_r=4",
        f"output_dir={out}", "task.eval_size=4", "rewards=[{name: 'tests.helpers:length_reward'}]",
        "rollout.group_size=4", "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.micro_batch_size=3",
        "train.steps=4", "train.checkpoint_every=1", "train.keep_last=2", "train.threads=1", "algo.beta=0.05",
        "train.lr=0.01", "eval.every=2", "eval.batch_size=4", "log.progress=false", "log.trackers=[]",
        "log.plot=false", "log.sample_token_ids=true",
    ]


def _records(run: Path, name: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / name).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(mark in k for mark in VOLATILE)} for r in rows]


def _cli(args, fault=None, **kw):
    env = {**os.environ, "RLVR_FAULT": fault or ""}
    command = [sys.executable, "-m", "rlvr", "train", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, **kw)


@pytest.fixture(scope="module")
def reference_runs(tiny_model_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    runs = {}
    try:
        for lora in (True, False):
            out = tmp_path_factory.mktemp(f"reference-{lora}") / "run"
            train(load_config(ROOT / "examples" / "demo.yaml", _overrides(tiny_model_dir, out, lora)))
            runs[lora] = out
    finally:
        torch.set_num_threads(threads)
    return runs


@pytest.mark.parametrize(
    "lora, fault, resumes_from",
    [
        (True, "after_generate@3", 2),  # mid-step: completions sampled, no update yet
        (True, "after_update@3", 2),  # weights updated in memory, step not checkpointed
        (True, "checkpoint_file_written@2", 1),  # torn checkpoint write: step 2 must not load
        (False, "after_generate@3", 2),  # full fine-tuning
    ],
)
def test_kill_and_resume_matches_uninterrupted(tiny_model_dir, tmp_path, reference_runs, lora, fault, resumes_from):
    out = tmp_path / "run"
    args = ["examples/demo.yaml", *_overrides(tiny_model_dir, out, lora)]
    crashed = _cli(args, fault=fault)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    resumed = _cli([*args, "resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {out / 'checkpoints' / f'step-{resumes_from:08d}'}" in resumed.stdout
    reference = reference_runs[lora]
    assert _records(out, "metrics.jsonl") == _records(reference, "metrics.jsonl")
    assert _records(out, "samples.jsonl") == _records(reference, "samples.jsonl")  # prompts, token ids, rewards
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_accuracy_after"] == json.loads((reference / "summary.json").read_text())["eval_accuracy_after"]


def test_ctrl_c_checkpoints_and_exits_cleanly(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = ["examples/demo.yaml", *_overrides(tiny_model_dir, out, True), "train.steps=50", "train.checkpoint_every=0"]
    proc = subprocess.Popen([sys.executable, "-m", "rlvr", "train", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").is_file() or len(_lines(out)) < 2:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted; saved" in stdout and "Continue with resume=auto" in stdout
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    assert checkpoints, stdout
    step = int(checkpoints[-1].name.split("-")[1])
    assert step == json.loads(_lines(out)[-1])["step"]  # the checkpoint is the last logged step


def _lines(out: Path) -> list[str]:
    path = out / "metrics.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


def test_resume_applies_a_changed_learning_rate_and_says_so(tiny_model_dir, tmp_path, capsys):
    """The optimizer state restores the lr it was saved with; the configured one must win, announced."""
    out = tmp_path / "run"
    base = _overrides(tiny_model_dir, out, True) + ["eval.every=0", "train.warmup_steps=4"]
    train(load_config(ROOT / "examples" / "demo.yaml", base + ["train.steps=2"]))
    capsys.readouterr()
    train(load_config(ROOT / "examples" / "demo.yaml",
                      base + ["train.steps=3", "train.lr=0.02", "train.weight_decay=0.1", "resume=auto"]))
    printed = capsys.readouterr().out
    assert "changed settings apply from step 3: train.steps 2 -> 3; train.lr 0.01 -> 0.02" in printed
    assert "train.weight_decay 0.0 -> 0.1" in printed
    records = _records(out, "metrics.jsonl")
    # warmup over 4 optimizer steps; a step logs the lr the scheduler set for the next update: after update 2
    # it is 0.01 * 3/4, after update 3 (which ran at the new base, 0.02 * 3/4) it is 0.02 * 4/4
    assert records[2]["update/lr"] == pytest.approx(0.01 * 3 / 4)
    assert records[3]["update/lr"] == pytest.approx(0.02 * 4 / 4)
    assert load_config(out / "config.yaml").train.lr == 0.02


def _two_steps(tiny_model_dir, out):
    base = _overrides(tiny_model_dir, out, True) + ["eval.every=0"]
    train(load_config(ROOT / "examples" / "demo.yaml", base + ["train.steps=2"]))
    return base


def test_a_torn_last_log_line_is_dropped_on_resume(tiny_model_dir, tmp_path, capsys):
    """A run killed in the middle of writing a record leaves a last line without its newline; resuming used to
    fail on it until the file was edited by hand."""
    out = tmp_path / "run"
    base = _two_steps(tiny_model_dir, out)
    steps = [r["step"] for r in _records(out, "metrics.jsonl")]
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 0.12')
    with (out / "samples.jsonl").open("a") as f:
        f.write('{"step": 3, "row": 1, "te')
    capsys.readouterr()
    train(load_config(ROOT / "examples" / "demo.yaml", base + ["train.steps=3", "resume=auto"]))
    printed = capsys.readouterr().out
    assert f"{out / 'metrics.jsonl'}: dropped its last line" in printed
    assert f"{out / 'samples.jsonl'}: dropped its last line" in printed
    assert [r["step"] for r in _records(out, "metrics.jsonl")] == [*steps, 3]
    assert {r["step"] for r in _records(out, "samples.jsonl")} == {1, 2, 3}


def test_a_corrupt_log_line_before_the_last_is_an_error_naming_it(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    base = _two_steps(tiny_model_dir, out)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1][: len(lines[1]) // 2] + "\n"  # damaged, yet not the last line: not a torn write
    (out / "metrics.jsonl").write_text("".join(lines))
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 2: not a record with a step .* fix or delete"):
        train(load_config(ROOT / "examples" / "demo.yaml", base + ["train.steps=3", "resume=auto"]))


def test_resume_with_a_refreshed_reference_matches_uninterrupted(tiny_model_dir, tmp_path):
    """algo.ref_sync_steps: the reference adapter (mixed at every step) is checkpointed, so a run killed after step
    2 and resumed logs the same KL and rewards as one that never stopped; without it the KL would restart from the
    starting model."""
    sync = ["algo.ref_sync_steps=1", "algo.ref_mixup_alpha=0.5"]
    whole = tmp_path / "whole"
    done = _cli(["examples/demo.yaml", *_overrides(tiny_model_dir, whole, True), *sync])
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "run"
    args = ["examples/demo.yaml", *_overrides(tiny_model_dir, out, True), *sync]
    crashed = _cli(args, fault="after_generate@3")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert (out / "checkpoints" / "step-00000002" / "reference.safetensors").is_file()
    resumed = _cli([*args, "resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got, want = _records(out, "metrics.jsonl"), _records(whole, "metrics.jsonl")
    assert got == want
    assert [r["update/kl"] for r in want if "update/kl" in r][2] > 0  # the refreshed reference is in use
