"""Exact resume: SIGKILL at several points, resume=auto, and the run matches an uninterrupted one bit for bit."""

import json
import multiprocessing
import multiprocessing.forkserver
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


# `rlvr train` runs that a test kills, interrupts or watches fail go to processes forked from a server process that
# has rlvr, torch and the model code imported: each runs the command's own function (rlvr.cli.main: argument
# parsing, errors as one line and exit status 2, an interrupt as 128 + the signal) in a process of its own that dies
# as the command dies, without the interpreter start-up and the allocator's re-execution of `python -m rlvr`
# (about 5 s on 2 busy cores, most of a short run's time; test_kill_and_resume_matches_uninterrupted keeps one case
# that runs the command itself). Forking from the server, which has run nothing, is safe where forking this process
# (threads, OpenMP pools) is not. tests/test_async.py and tests/test_diloco.py use these too.
FORKSERVER_PRELOAD = ["tests.test_resume", "rlvr.cli", "peft", "transformers.models.llama.modeling_llama"]


def _forked_rlvr(argv: list[str], fault: str, log: str) -> None:
    """In the forked process: output to ``log``, RLVR_FAULT=fault, then `rlvr ARGV`; its status is the process's."""
    import threading

    import tqdm

    from rlvr.cli import main

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1), os.dup2(fd, 2)
    # tqdm's default lock holds a multiprocessing semaphore, which a SIGKILLed process never releases: the shared
    # resource tracker would warn about it when the test session ends
    tqdm.tqdm.set_lock(threading.RLock())
    os.environ["RLVR_FAULT"] = fault
    sys.exit(main(argv))


def start_fork_server() -> multiprocessing.context.BaseContext:
    """The fork server's context; the server is started (once per session) if it is not running: it imports
    FORKSERVER_PRELOAD in the background, so a module starts it early (fork_server, below) and its first forked run
    does not wait for that."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # applies when the server starts
    multiprocessing.forkserver.ensure_running()
    return ctx


@pytest.fixture(scope="module", autouse=True)
def fork_server():
    start_fork_server()


def start_forked_train(overrides: list[str], fault: str, log: Path,
                       config: Path = ROOT / "examples" / "demo.yaml") -> multiprocessing.Process:
    """Start `rlvr train CONFIG OVERRIDES` with RLVR_FAULT=fault in a forked process, its output in ``log``."""
    argv = ["train", str(config), *overrides]
    proc = start_fork_server().Process(target=_forked_rlvr, args=(argv, fault, str(log)), daemon=True)
    proc.start()
    return proc


def join_forked(proc: multiprocessing.Process, timeout: float = 300) -> int:
    """Its exit code (-9: SIGKILLed) once it has ended; killed after ``timeout`` seconds (then the code says so)."""
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    return proc.exitcode


def train_killed(overrides: list[str], fault: str, log: Path, **kw) -> int:
    """`rlvr train` in a forked process that RLVR_FAULT=fault SIGKILLs; its exit code (-9 expected)."""
    return join_forked(start_forked_train(overrides, fault, log, **kw))


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.is_file() else ""


def _train_here(overrides: list[str]) -> dict:
    """``rlvr train`` in this process (no interpreter start-up): what the CLI runs, torch's thread count restored
    after (train.threads=1 sets it)."""
    threads = torch.get_num_threads()
    try:
        return train(load_config(ROOT / "examples" / "demo.yaml", overrides))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir, tmp_path_factory):
    """``reference_run(lora, *extra)``: the directory of an uninterrupted run of that configuration, trained in-process
    once per module and shared by every case that compares against it (cases differ only in their kill point)."""
    runs: dict[tuple, Path] = {}

    def run(lora: bool, *extra: str) -> Path:
        key = (lora, *extra)
        if key not in runs:
            out = tmp_path_factory.mktemp(f"reference-{lora}") / "run"
            _train_here([*_overrides(tiny_model_dir, out, lora), *extra])
            runs[key] = out
        return runs[key]

    return run


def _kill_and_resume(args: list[str], fault: str, how: str, capsys, log: Path) -> str:
    """Run ``rlvr train args`` until RLVR_FAULT=fault SIGKILLs it, then resume it (resume=auto); returns what the
    resume printed. ``cli``: both are `rlvr train` processes. ``fork``: the killed run is a forked process (see
    start_forked_train) and the resume runs in this process (it reads only what the killed one left on disk):
    neither starts an interpreter."""
    if how == "cli":
        crashed = _cli(args, fault=fault)
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
        resumed = _cli([*args, "resume=auto"])
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        return resumed.stdout
    assert train_killed(args[1:], fault, log, config=ROOT / args[0]) == -signal.SIGKILL, _tail(log)
    capsys.readouterr()
    _train_here([*args[1:], "resume=auto"])  # args[0] is the config file
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "lora, fault, resumes_from, how",
    [
        pytest.param(True, "after_generate@3", 2, "cli", marks=pytest.mark.long),  # mid-step: sampled, no update
        (True, "after_update@3", 2, "fork"),  # weights updated in memory, step not checkpointed
        (True, "checkpoint_file_written@2", 1, "fork"),  # torn checkpoint write: step 2 must not load
        (False, "after_generate@3", 2, "fork"),  # full fine-tuning
    ],
)
def test_kill_and_resume_matches_uninterrupted(tiny_model_dir, tmp_path, reference_run, capsys, lora, fault,
                                               resumes_from, how):
    """The killed run is always a process of its own, SIGKILLed at the fault point; one case runs and resumes it
    with the `rlvr train` command, the others fork it and resume in this process (no interpreter start-ups)."""
    out = tmp_path / "run"
    args = ["examples/demo.yaml", *_overrides(tiny_model_dir, out, lora)]
    printed = _kill_and_resume(args, fault, how, capsys, tmp_path / "killed.log")
    assert f"resuming from {out / 'checkpoints' / f'step-{resumes_from:08d}'}" in printed
    reference = reference_run(lora)
    assert _records(out, "metrics.jsonl") == _records(reference, "metrics.jsonl")
    assert _records(out, "samples.jsonl") == _records(reference, "samples.jsonl")  # prompts, token ids, rewards
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_accuracy_after"] == json.loads((reference / "summary.json").read_text())["eval_accuracy_after"]


def test_ctrl_c_checkpoints_and_exits_cleanly(tiny_model_dir, tmp_path):
    """`rlvr train` in a forked process (start_forked_train), interrupted as Ctrl-C interrupts it."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    overrides = [*_overrides(tiny_model_dir, out, True), "train.steps=50", "train.checkpoint_every=0"]
    proc = start_forked_train(overrides, "", log)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").is_file() or len(_lines(out)) < 2:
        assert proc.is_alive(), _tail(log)
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGINT)
    assert join_forked(proc, timeout=120) == 130, _tail(log)
    stdout = log.read_text()
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


def test_resume_with_a_refreshed_reference_matches_uninterrupted(tiny_model_dir, tmp_path, reference_run, capsys):
    """algo.ref_sync_steps: the reference adapter (mixed at every step) is checkpointed, so a run killed after step
    2 and resumed logs the same KL and rewards as one that never stopped; without it the KL would restart from the
    starting model. The uninterrupted run and the resume run in this process; the killed run is a forked process."""
    sync = ["algo.ref_sync_steps=1", "algo.ref_mixup_alpha=0.5"]
    whole = reference_run(True, *sync)
    out, log = tmp_path / "run", tmp_path / "killed.log"
    overrides = [*_overrides(tiny_model_dir, out, True), *sync]
    assert train_killed(overrides, "after_generate@3", log) == -signal.SIGKILL, _tail(log)
    assert (out / "checkpoints" / "step-00000002" / "reference.safetensors").is_file()
    capsys.readouterr()
    _train_here([*overrides, "resume=auto"])
    assert f"resuming from {out / 'checkpoints' / 'step-00000002'}" in capsys.readouterr().out
    got, want = _records(out, "metrics.jsonl"), _records(whole, "metrics.jsonl")
    assert got == want
    assert [r["update/kl"] for r in want if "update/kl" in r][2] > 0  # the refreshed reference is in use


def test_a_checkpoint_path_continues_into_a_new_output_dir(tiny_model_dir, tmp_path):
    """resume=PATH with an output_dir that does not exist yet: the run starts there from the checkpoint's step and
    logs what the uninterrupted run logged for the next step."""
    out, other = tmp_path / "run", tmp_path / "other"
    base = _overrides(tiny_model_dir, out, True) + ["eval.every=0"]
    train(load_config(ROOT / "examples" / "demo.yaml", base + ["train.steps=3"]))
    moved = [o for o in base if not o.startswith("output_dir=")] + [f"output_dir={other}"]
    train(load_config(ROOT / "examples" / "demo.yaml",
                      moved + ["train.steps=3", f"resume={out / 'checkpoints' / 'step-00000002'}"]))
    assert _records(other, "metrics.jsonl") == [r for r in _records(out, "metrics.jsonl") if r["step"] == 3]
